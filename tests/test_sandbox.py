"""The code sandbox and the code reward: correct code earns its tests, hostile code earns 0 and the
host is untouched (no file written or read outside, no connection made, no process left behind)."""

import os
import shutil
import socket
import subprocess
import time

import pytest

from rewards import datasets
from rewards.code import code_reward, extract_code, run_tests
from rewards.sandbox import Limits, check_available, run_program

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
], ids=["fork-bomb", "infinite-loop", "memory-hog", "huge-output", "write-system", "read-shadow"])
def test_hostile_programs_earn_nothing_and_end_within_the_limits(attack):
    start = time.monotonic()
    assert code_reward(f"```python\n{attack}\n{SOLUTION}```", ADD_3, cpu_seconds=2, wall_seconds=6,
                       memory_mb=256) == 0.0
    assert time.monotonic() - start < 15
    assert not os.path.exists("/usr/escaped")


def test_huge_output_is_capped_at_the_file_size_limit():
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=QUICK)
    assert not result.ok and len(result.stdout) <= QUICK.file_size_mb << 20


def test_files_outside_the_sandbox_can_be_neither_written_nor_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-token")
    escaped = tmp_path / "escaped.txt"
    program = f"""
import os
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
    result = run_program("import os\nprint(dict(os.environ))\nprint(open('/proc/self/environ').read())",
                         limits=QUICK)
    assert result.ok, result.stderr
    assert "env-secret-token" not in result.stdout and "MINTFLOW_TEST_SECRET" not in result.stdout


def test_it_sees_only_its_own_processes_and_cannot_signal_the_host():
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        program = f"""
import os, signal
print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
for pid in ({sentinel.pid}, {os.getpid()}, os.getppid(), -1):
    try:
        os.kill(pid, signal.SIGKILL)
        print('signalled', pid)
    except OSError as e:
        print(pid, type(e).__name__)
print('still here')
"""
        result = run_program(program, limits=QUICK)
        visible = eval(result.stdout.splitlines()[0])  # noqa: S307 - our own program's printed list
        assert len(visible) <= 3, visible  # bubblewrap's init, the program, maybe one more
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
