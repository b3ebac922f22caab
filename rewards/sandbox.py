"""Run untrusted code in a bubblewrap sandbox.

The program sees a read-only ``/usr``, its own ``/proc`` (only its processes), a minimal read-only
``/dev`` and three private size-limited tmpfs folders (``/sandbox``, its working folder, ``/tmp``
and ``/dev/shm``); nothing else of the host, and nothing else it can write. It is the init of its
PID namespace and cannot make namespaces of its own (bubblewrap 0.8 or later). It has no network
(a new, empty network namespace), no environment from the host (``--clearenv``), no capabilities,
and runs under a uid of its own (an unprivileged user, picked per run, when we are root:
RLIMIT_NPROC does not bind root).
CPU time, address space, file size (which also caps its output), open files and processes
are limited with ``prlimit``; the wall clock by us. When the program ends or is killed, the
kernel kills everything left in its PID namespace, so nothing outlives the run.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID_BASE = 200_000  # far above any system or login uid; nothing on the host owns files there
_uids = itertools.count()


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512  # address space: Python itself needs ~30 MB
    file_size_mb: int = 4  # any file it writes, its stdout and stderr included
    processes: int = 16
    open_files: int = 64
    tmpfs_mb: int = 32  # each of /sandbox, /tmp and /dev/shm


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Execution:
    """How a run ended: exit status (negative: killed by that signal), output, and whether we timed it out."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run the program: bubblewrap (or prlimit/setpriv) is missing, cannot
    create namespaces here, or died before its program ended. Not the program's fault: a reward
    must not read it as a failed program (the scoring task retries it, then reports it)."""


def check_available() -> None:
    """Raise SandboxUnavailable, saying what to install, unless a sandboxed ``true`` runs."""
    missing = [tool for tool in ("bwrap", "prlimit", "setpriv") if shutil.which(tool) is None]
    if missing:
        raise SandboxUnavailable(f"code sandbox: {', '.join(missing)} not found; install Debian's bubblewrap "
                                 "and util-linux (make setup does: apt-get install bubblewrap)")
    result = run_program("", limits=Limits(wall_seconds=30))
    if not result.ok:
        raise SandboxUnavailable(f"code sandbox: bubblewrap could not start a sandbox here "
                                 f"(exit {result.returncode}): {result.stderr.strip()[-500:]}")


def run_program(source: str, stdin: str = "", limits: Limits = DEFAULT_LIMITS,
                interpreter: str = "/usr/bin/python3") -> Execution:
    """Run Python ``source`` in a fresh sandbox and return how it ended; never raises for what the
    program does. Raises SandboxUnavailable when the sandbox itself fails (bubblewrap reports on a
    status pipe when the program started and how it ended; a run without both did not run)."""
    with tempfile.TemporaryDirectory(prefix="mintflow-sandbox-") as host_dir:
        host = Path(host_dir)
        (host / "stdin").write_text(stdin, encoding="utf-8")
        program = os.memfd_create("program")
        status_read, status_write = os.pipe()
        try:
            os.write(program, source.encode("utf-8"))
            os.lseek(program, 0, os.SEEK_SET)
            command = _command(program, limits, interpreter, status_write)
            with open(host / "stdin", "rb") as stdin_file, open(host / "stdout", "wb") as out, \
                    open(host / "stderr", "wb") as err:
                start = time.monotonic()
                process = subprocess.Popen(command, stdin=stdin_file, stdout=out, stderr=err,
                                           pass_fds=(program, status_write), start_new_session=True,
                                           env={"PATH": os.environ.get("PATH", "/usr/bin")})
                os.close(status_write)
                status_write = -1
                timed_out = False
                try:
                    process.wait(timeout=limits.wall_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(process)
                seconds = time.monotonic() - start
            with os.fdopen(status_read, "rb") as status_file:
                status_read = -1
                status = status_file.read().decode("utf-8", errors="replace")
        finally:
            for fd in (program, status_read, status_write):
                if fd >= 0:
                    os.close(fd)
        cap = limits.file_size_mb << 20
        execution = Execution(returncode=process.returncode, stdout=_read(host / "stdout", cap),
                              stderr=_read(host / "stderr", cap), timed_out=timed_out, seconds=seconds)
    if not timed_out and '"child-pid"' not in status:
        raise SandboxUnavailable(f"code sandbox: the sandbox did not start (exit {execution.returncode}): "
                                 f"{execution.stderr.strip()[-500:]}")
    if not timed_out and '"exit-code"' not in status:
        raise SandboxUnavailable(f"code sandbox: the sandbox died (exit {execution.returncode}) before its "
                                 "program ended")
    return execution


def _command(program_fd: int, limits: Limits, interpreter: str, status_fd: int) -> list[str]:
    mb = 1 << 20
    command = ["prlimit", f"--cpu={limits.cpu_seconds}", f"--as={limits.memory_mb * mb}",
               f"--fsize={limits.file_size_mb * mb}", f"--nofile={limits.open_files}", "--core=0"]
    if os.geteuid() == 0:
        uid = SANDBOX_UID_BASE + (os.getpid() * 1024 + next(_uids)) % 1_000_000
        command += [f"--nproc={limits.processes}", "--", "setpriv", f"--reuid={uid}", f"--regid={uid}",
                    "--clear-groups", "--"]
    else:  # RLIMIT_NPROC counts all of this user's processes, so leave room for the ones already running
        command += [f"--nproc={_processes_of(os.getuid()) + limits.processes}", "--"]
    tmpfs = str(limits.tmpfs_mb * mb)
    # --as-pid-1: the program is its PID namespace's init, with no bubblewrap reaper beside it: that
    # reaper ran as the program's uid, so the program could ptrace it (and read its environ, the host's
    # PATH); now every process it can name is its own. --disable-userns: in a user namespace of its own
    # the program could mount a tmpfs of any size and fill host memory past every limit below.
    command += ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL", "--json-status-fd", str(status_fd),
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox",
                "--setenv", "LANG", "C.UTF-8", "--hostname", "sandbox",
                "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib"]
    if os.path.isdir("/usr/lib64"):
        command += ["--symlink", "usr/lib64", "/lib64"]
    command += ["--proc", "/proc", "--dev", "/dev", "--size", tmpfs, "--tmpfs", "/sandbox", "--size", tmpfs,
                "--tmpfs", "/tmp", "--size", tmpfs, "--tmpfs", "/dev/shm", "--chdir", "/sandbox",
                "--file", str(program_fd), "/sandbox/main.py",
                # bubblewrap's own / and /dev are tmpfs without a size limit: writable, they let the program
                # fill host memory past tmpfs_mb (4 GB in 2 CPU seconds), so they are remounted read-only
                "--remount-ro", "/dev", "--remount-ro", "/",
                "--", interpreter, "-I", "-B", "/sandbox/main.py"]
    return command


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except FileNotFoundError:
                pass
    return count


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the run's process group: bubblewrap dies, and with it its PID namespace."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _read(path: Path, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")
