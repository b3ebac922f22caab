"""The code sandbox and the code reward: correct code earns its tests, hostile code earns 0 and the
host is untouched (no file written or read outside, no connection made, no process left behind)."""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rewards import datasets
from rewards.code import code_reward, extract_code, run_tests
from rewards.sandbox import Limits, SandboxUnavailable, check_available, run_program

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (make setup installs Debian's bubblewrap)")

QUICK = Limits(cpu_seconds=2, wall_seconds=6, memory_mb=256, processes=16)
ADD_3 = {"id": "fn-add_3", "tests": ["assert add_3(0) == 3", "assert add_3(7) == 10", "assert add_3(-3) == 0"],
         "entry_point": "add_3"}
SOLUTION = "def add_3(x):\n    return x + 3\n"
MARKER = "1234.5"  # a sleep duration no other process on the host uses


def _leftovers() -> list[str]:
    """Host processes still running sandboxed code (the program, its forks, or its marked children)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = open(f"/proc/{entry.name}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "/sandbox/main.py" in cmdline or MARKER in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


def _a_fresh_sandbox_follows() -> None:
    """The next run works and starts from empty folders: nothing an earlier run made or planted is left."""
    result = run_program("import os\nprint([sorted(os.listdir(f)) for f in ('/sandbox', '/tmp', '/dev/shm')])",
                         limits=QUICK)
    assert result.ok and result.stdout.strip() == "[['main.py'], [], []]", result


def _on_the_host(source: str) -> str:
    """What a probe prints when run outside the sandbox: the control that shows it would see an escape."""
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=30).stdout


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    deadline = time.monotonic() + 5
    while _leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers() == []


def test_the_sandbox_starts_here():
    check_available()


def test_reference_solutions_pass_all_their_tests():
    train, held_out = datasets.GENERATED["python_functions"]()
    for problem in held_out + train[::8]:
        outcome = run_tests(problem["answer"], problem["tests"])
        assert outcome.passed == outcome.total == len(problem["tests"]), (problem["id"], outcome.execution)


def test_humaneval_reference_solutions_pass():
    problems = datasets.eval_set("humaneval", 164)
    assert len(problems) == 164
    for problem in problems[::20]:
        assert code_reward(f"```python\n{problem['answer']}```", problem, wall_seconds=20) == 1.0, problem["id"]


def test_reward_is_the_fraction_of_tests_passed():
    assert code_reward(f"Here you go:\n```python\n{SOLUTION}```", ADD_3) == 1.0
    assert code_reward("```python\ndef add_3(x):\n    return 3\n```", ADD_3) == pytest.approx(1 / 3)
    assert code_reward("```python\ndef add_3(x):\n    return 3\n```", ADD_3, all_or_nothing=True) == 0.0
    assert code_reward("def add_3(x) return x + 3", ADD_3) == 0.0  # a syntax error passes nothing


def test_code_is_taken_from_the_block_that_defines_the_entry_point():
    reply = ("```python\nimport math\n```\nthen\n```python\ndef add_3(x):\n    return x + 3\n```\n"
             "and\n```py\nprint(1)\n```")
    assert extract_code(reply, ADD_3) == SOLUTION
    assert extract_code("```python\ndef add_3(x):\n    return x + 3", ADD_3) == SOLUTION.strip()  # unterminated
    assert extract_code("    return x + 3\n", {**ADD_3, "prompt_code": "def add_3(x):\n"}) == SOLUTION


def test_a_problem_without_tests_is_refused_clearly():
    with pytest.raises(ValueError, match="no 'tests'"):
        code_reward(SOLUTION, {"id": "x"})


# Each hostile program runs its attack first and only then defines the solution, so the
# reward is 0 unless the attack went through silently.
@pytest.mark.parametrize("attack", [
    "import os\nwhile True:\n    os.fork()",
    "while True:\n    pass",
    "hog = bytearray(2 * 1024 ** 3)",
    "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
    "open('/usr/escaped', 'w').write('out')",
    "open('/etc/shadow').read()",
    "n = 0\nwhile True:\n    n += 1\n    for folder in ('/sandbox', '/tmp', '/dev/shm'):\n"
    "        open(f'{folder}/{n}', 'w').close()",
    "import os\nos.chdir('/tmp')\nwhile True:\n    os.mkdir('d')\n    os.chdir('d')",
], ids=["fork-bomb", "infinite-loop", "memory-hog", "huge-output", "write-system", "read-shadow", "many-files",
        "deep-directories"])
def test_hostile_programs_earn_nothing_and_end_within_the_limits(attack):
    start = time.monotonic()
    assert code_reward(f"```python\n{attack}\n{SOLUTION}```", ADD_3, cpu_seconds=2, wall_seconds=6,
                       memory_mb=256) == 0.0
    assert time.monotonic() - start < 15
    assert not os.path.exists("/usr/escaped")
    _a_fresh_sandbox_follows()


def test_huge_output_is_capped_at_the_file_size_limit():
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=QUICK)
    assert not result.ok and len(result.stdout) <= QUICK.file_size_mb << 20


def test_files_outside_the_sandbox_can_be_neither_written_nor_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-token")
    escaped = tmp_path / "escaped.txt"
    program = f"""
import os
import re
for path in [{str(secret)!r}, '/etc/shadow', '/root/.bashrc', '/work', '/home']:
    try:
        print(path, open(path).read())
    except OSError as e:
        print(path, type(e).__name__)
for path in [{str(escaped)!r}, '/usr/escaped', '/etc/escaped']:
    try:
        open(path, 'w').write('escaped')
        print('wrote', path)
    except OSError as e:
        print(path, type(e).__name__)
open('/sandbox/inside.txt', 'w').write('fine')  # its own working folder is writable
print('inside', open('/sandbox/inside.txt').read())
"""
    result = run_program(program, limits=QUICK)
    assert result.ok, result.stderr
    assert "host-secret-token" not in result.stdout and "root:" not in result.stdout
    assert "wrote" not in result.stdout and "inside fine" in result.stdout
    assert not escaped.exists() and not os.path.exists("/usr/escaped") and not os.path.exists("/etc/escaped")


def test_no_network_even_to_a_listening_host_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        attack = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        assert code_reward(f"```python\n{attack}\n{SOLUTION}```", ADD_3, cpu_seconds=2, wall_seconds=6) == 0.0
        with pytest.raises(TimeoutError):
            listener.accept()


def test_the_host_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("MINTFLOW_TEST_SECRET", "env-secret-token")
    # PATH is the one variable the harness passes on (to find prlimit, setpriv and bwrap)
    monkeypatch.setenv("PATH", f"{os.environ['PATH']}:/path-secret-token")
    probe = """
import os
import re
print(dict(os.environ))
for pid in ['self'] + [p for p in os.listdir('/proc') if p.isdigit()]:  # /proc/1/environ among them
    print(pid, open(f'/proc/{pid}/environ').read())
"""
    control = _on_the_host(probe)
    assert "env-secret-token" in control and "path-secret-token" in control
    result = run_program(probe, limits=QUICK)
    assert result.ok, result.stderr
    assert "\n1 PATH=" in result.stdout  # it did read /proc/1/environ
    for leak in ("env-secret-token", "MINTFLOW_TEST_SECRET", "path-secret-token"):
        assert leak not in result.stdout


def test_it_sees_only_its_own_processes_and_cannot_signal_the_host():
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        program = f"""
import os, signal
print({{p: open(f'/proc/{{p}}/cmdline').read().split('\\0')[:-1] for p in os.listdir('/proc') if p.isdigit()}})
for pid in ({sentinel.pid}, {os.getpid()}, os.getppid(), -1):
    try:
        os.kill(pid, signal.SIGKILL)
        print('signalled', pid)
    except OSError as e:
        print(pid, type(e).__name__)
print('still here')
"""
        result = run_program(program, limits=QUICK)
        visible = eval(result.stdout.splitlines()[0])  # noqa: S307 - our own program's printed {pid: cmdline}
        assert visible == {"1": ["/usr/bin/python3", "-I", "-B", "/sandbox/main.py"]}  # itself, its namespace's init
        assert "still here" in result.stdout  # kill(-1) reached nothing it could hurt
        assert sentinel.poll() is None  # and the host process survived
    finally:
        sentinel.kill()
        sentinel.wait()


def test_a_background_process_does_not_outlive_the_run():
    program = f"""
import os, subprocess
subprocess.Popen(['sleep', '{MARKER}'], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    os.execvp('sleep', ['sleep', '{MARKER}'])
os._exit(0)
"""
    result = run_program(program, limits=QUICK)
    assert result.returncode == 0 and not result.timed_out
    # the autouse fixture checks that no `sleep 1234.5` is left on the host


def test_symlinks_it_plants_lead_nowhere_on_the_host(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the host's working folder
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-token")
    escaped = tmp_path / "escaped.txt"
    targets = [str(secret), str(tmp_path), "/etc/shadow", "/root", f"/proc/1/root{secret}",
               f"/proc/self/root{tmp_path}", f"../../../../../..{secret}"]
    program = f"""
import os
import re
links = [f'{{folder}}/link{{n}}' for folder in ('/sandbox', '/tmp') for n in range({len(targets)})]
for link, target in zip(links, {targets!r} * 2):
    os.symlink(target, link)
for link in links:
    try:
        print('read', link, os.listdir(link) if os.path.isdir(link) else open(link).read())
    except OSError as e:
        print(link, type(e).__name__)
try:  # the host's folders made again inside, so that writing through a link lands somewhere
    os.makedirs({str(tmp_path)!r}, exist_ok=True)
except OSError as e:
    print('makedirs', type(e).__name__)
# and links where a harness might write next: the program file it copies in, files named like its output
os.remove('/sandbox/main.py')
for link in ('/sandbox/out', '/tmp/out', '/sandbox/main.py', '/sandbox/stdout', '/tmp/stdout', '/tmp/stderr'):
    os.symlink({str(escaped)!r}, link)
    with open(link, 'a') as f:
        f.write('escaped')
print('planted')
"""
    result = run_program(program, limits=QUICK)
    assert result.ok and "planted" in result.stdout, result.stderr
    assert "host-secret-token" not in result.stdout and "read " not in result.stdout  # every read failed
    assert sorted(os.listdir(tmp_path)) == ["secret.txt"] and secret.read_text() == "host-secret-token"
    _a_fresh_sandbox_follows()
    assert not escaped.exists()


def test_proc_and_sys_show_no_host_mounts_and_take_no_writes():
    program = """
import os
import re
print([line.split()[4] for line in open('/proc/self/mountinfo')])
for path in ('/proc/sys/kernel/core_pattern', '/proc/sys/kernel/hostname', '/proc/sys/vm/drop_caches',
             '/proc/sysrq-trigger', '/sys/kernel/uevent_helper', '/sys/fs/cgroup/cgroup.procs'):
    try:
        os.close(os.open(path, os.O_WRONLY))  # opening shows it could write; nothing is written
        print('writable', path)
    except OSError as e:
        print(path, type(e).__name__)
"""
    result = run_program(program, limits=QUICK)
    assert result.ok, result.stderr
    mounts = eval(result.stdout.splitlines()[0])  # noqa: S307 - our own program's printed list
    assert all(m in ("/", "/usr", "/proc", "/sandbox", "/tmp", "/dev") or m.startswith("/dev/")
               for m in mounts), mounts  # no host folder (this checkout, host tmp, home) is mounted inside
    assert "writable" not in result.stdout


PTRACE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.process_vm_readv.restype = ctypes.c_ssize_t

class IoVec(ctypes.Structure):
    _fields_ = [('base', ctypes.c_void_p), ('length', ctypes.c_size_t)]

def first_mapping(pid):
    try:
        with open(f'/proc/{{pid}}/maps') as maps:
            return int(maps.readline().split('-')[0], 16)
    except (OSError, ValueError):
        return 0x400000

for pid in {targets}:
    for request in (0x4206, 16):  # PTRACE_SEIZE, PTRACE_ATTACH
        if libc.ptrace(request, pid, None, None) == 0:
            print('attached', pid)
            break
    buffer = ctypes.create_string_buffer(8)
    mine, theirs = IoVec(ctypes.addressof(buffer), 8), IoVec(first_mapping(pid), 8)
    if libc.process_vm_readv(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0) == 8:
        print('read from', pid)
print('tried', {targets})
"""


def test_it_can_ptrace_no_process():
    # control: on the host the probe attaches to, and reads, a child of its own (a cat that ends with it)
    control = _on_the_host(PTRACE.format(targets="[__import__('subprocess').Popen(['cat'], stdin=-1).pid]"))
    assert "attached" in control and "read from" in control, control
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        # the host's processes, PID 1, its parent and every other process its /proc lists
        targets = (f"[pid for pid in [{os.getpid()}, {sentinel.pid}, 1, os.getppid(), "
                   "*map(int, filter(str.isdigit, os.listdir('/proc')))] if pid != os.getpid()]")
        result = run_program(PTRACE.format(targets=targets), limits=QUICK)
        assert result.ok and "tried" in result.stdout, result.stderr
        assert "attached" not in result.stdout and "read from" not in result.stdout
        assert sentinel.poll() is None
    finally:
        sentinel.kill()
        sentinel.wait()


def test_only_the_size_limited_folders_take_data():
    limits = Limits(cpu_seconds=2, wall_seconds=6, memory_mb=256, tmpfs_mb=4)
    program = """
import os
import re
for folder in ('/', '/dev', '/etc', '/proc', '/usr', '/dev/shm', '/sandbox', '/tmp'):
    stored = 0
    try:
        os.makedirs(f'{folder}/fill', exist_ok=True)
        while stored < 64:  # MB: far more than a 4 MB folder holds
            with open(f'{folder}/fill/{stored}', 'wb') as f:
                f.write(bytes(1 << 20))
            stored += 1
    except OSError:
        pass
    print(folder, stored)
"""
    result = run_program(program, limits=limits)
    assert result.ok, result.stderr
    stored = {folder: int(mb) for folder, mb in (line.split() for line in result.stdout.splitlines())}
    assert all(stored[folder] == 0 for folder in ("/", "/dev", "/etc", "/proc", "/usr")), stored  # read-only
    assert all(0 < stored[folder] <= limits.tmpfs_mb for folder in ("/dev/shm", "/sandbox", "/tmp")), stored


def test_it_cannot_mount_a_filesystem_of_its_own():
    program = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
os.makedirs('/tmp/own', exist_ok=True)
if libc.unshare(0x10000000 | 0x20000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS: every capability, in there
    print('unshared')
    for name, text in (('uid_map', f'0 {uid} 1'), ('setgroups', 'deny'), ('gid_map', f'0 {gid} 1')):
        with open(f'/proc/self/{name}', 'w') as f:
            f.write(text)
if libc.mount(b'none', b'/tmp/own', b'tmpfs', 0, None) == 0:  # a tmpfs of any size it likes
    print('mounted', os.statvfs('/tmp/own').f_blocks)
print('tried')
"""
    result = run_program(program, limits=QUICK)
    assert result.ok and "tried" in result.stdout, result.stderr
    assert "unshared" not in result.stdout and "mounted" not in result.stdout


# ------------------------------------------------------------ the sandbox itself failing
@pytest.fixture
def fake_bin(monkeypatch):
    """A folder first on PATH that the sandbox's unprivileged uid can read and write (pytest's are root's)."""
    folder = Path(tempfile.mkdtemp(prefix="mintflow-fake-bin-"))
    folder.chmod(0o777)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    yield folder
    shutil.rmtree(folder)


def _fake_bwrap(folder: Path, script: str) -> None:
    """A ``bwrap`` running ``script`` in ``folder`` (the sandbox's command finds it on PATH)."""
    fake = folder / "bwrap"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)


def _solved_problem() -> tuple[dict, str]:
    problem = datasets.eval_set("python_functions", 1)[0]
    return problem, f"```python\n{problem['answer']}\n```"


@pytest.mark.parametrize("failure, script, message", [
    ("cannot start", 'echo "bwrap: Creating new namespace failed: Operation not permitted" >&2; exit 1',
     "did not start (exit 1): bwrap: Creating new namespace failed"),
    ("killed mid-run",  # it reports the program started, as bubblewrap does, then dies (an OOM kill)
     'for arg in "$@"; do [ "$previous" = --json-status-fd ] && fd=$arg; previous=$arg; done\n'
     '/usr/bin/python3 -c "import os, sys; os.write(int(sys.argv[1]), b\'{\\"child-pid\\": 7}\')" $fd\nkill -9 $$',
     "died (exit -9) before its program ended"),
])
def test_a_sandbox_that_fails_is_an_error_not_a_reward_of_zero(failure, script, message, fake_bin):
    _fake_bwrap(fake_bin, script)
    problem, completion = _solved_problem()
    with pytest.raises(SandboxUnavailable, match=re.escape(message)):
        code_reward(completion, problem)


def test_a_program_cannot_pass_itself_off_as_a_sandbox_failure():
    result = run_program('import sys; print("bwrap: Creating new namespace failed", file=sys.stderr); sys.exit(1)')
    assert result.returncode == 1 and "bwrap:" in result.stderr  # an ordinary failed program: reward 0, no retry


def test_scoring_retries_a_sandbox_that_failed_then_reports_one_that_keeps_failing(harness, fake_bin, tmp_path,
                                                                                   monkeypatch):
    from tasks.common import write_json
    from tasks.rollouts import RewardError, score

    problem, completion = _solved_problem()
    rollouts = write_json("rollouts", f"sandbox-retry-{tmp_path.name}", {"groups": [
        {"problem": problem, "prompt_tokens": [1], "samples": [{"text": completion}, {"text": "no code"}]}]})
    monkeypatch.setattr("tasks.rollouts.score.retry_delay_seconds", [0, 0, 0])
    attempts = fake_bin / "attempts"  # written by each run's own uid
    attempts.touch(0o666)
    attempts.chmod(0o666)
    _fake_bwrap(fake_bin, f'echo x >> {attempts}\n[ "$(wc -l < {attempts})" -ge 2 ] && exec /usr/bin/bwrap "$@"\n'
                          'echo "bwrap: out of memory" >&2; exit 1')
    assert score(rollouts, reward="code", reward_options={}) == [[1.0, 0.0]]  # the first attempt failed
    assert attempts.read_text().count("x") >= 2

    _fake_bwrap(fake_bin, 'echo "bwrap: out of memory" >&2; exit 1')
    with pytest.raises(RewardError, match=r"reward 'code' failed on group 0 sample 0 .*did not start"):
        score(rollouts, reward="code", reward_options={"all_or_nothing": True})
