"""Service mode: a Prefect server, a process worker and an MLflow tracking server, on 127.0.0.1.

    mintflow serve [--home DIR] [--prefect-port 4200] [--mlflow-port 5000]

Everything lives under one folder (``--home``, default ``$MINTFLOW_HOME`` or ./data):
``prefect/`` (the Prefect database and persisted task results), ``mlflow/`` (``mlflow.db``
and the artifact store), and the pipeline's own files (checkpoints, rollouts). The worker
polls the ``mintflow`` process work pool, created if missing with a concurrency limit of 1:
one training run at a time on this machine. ``servers.json`` in the home tells other
commands (``mintflow deploy``, ``mintflow sweep``) where the servers are. Ctrl-C stops all three.

``serve`` supervises them: one that dies (a crash, an OOM kill) is started again on the same port
with the same database, and ``servers.json`` gets its new pid; each restart is a line in
``logs/serve.log``. One that dies more than ``RESTARTS`` times in ``RESTART_WINDOW_S`` seconds stops
everything, naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

WORK_POOL = "mintflow"
SERVERS_FILE = "servers.json"
BIN = Path(sys.executable).parent
NAMES = ("prefect-server", "mlflow-server", "prefect-worker")  # the order of Servers.processes
RESTARTS = 5  # a process that dies more often than this ...
RESTART_WINDOW_S = 600.0  # ... within this many seconds stops everything


@dataclass
class Servers:
    home: Path
    prefect_url: str
    mlflow_url: str
    pool: str = WORK_POOL
    prefect_port: int = 4200
    mlflow_port: int = 5000
    processes: list[subprocess.Popen] = field(default_factory=list)  # in the order of NAMES

    def env(self) -> dict[str, str]:
        """What a process needs to use these servers (the worker passes it on to every flow run)."""
        return server_env(self.home, self.prefect_url, self.mlflow_url)


def server_env(home: Path, prefect_url: str, mlflow_url: str) -> dict[str, str]:
    return {**_home_env(home), "PREFECT_API_URL": prefect_url, "MLFLOW_TRACKING_URI": mlflow_url}


def _home_env(home: Path) -> dict[str, str]:
    from flows.allocator import jemalloc_env

    return {**jemalloc_env(), "MINTFLOW_HOME": str(home), "PREFECT_HOME": str(home / "prefect"),
            "PREFECT_LOCAL_STORAGE_PATH": str(home / "prefect" / "storage"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "TOKENIZERS_PARALLELISM": "false"}


def wait_healthy(url: str, process: subprocess.Popen, name: str, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode} before it was ready; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not answer {url} within {timeout:.0f} s; see {log}")


def _spawn(name: str, command: list[str], env: dict[str, str], logs: Path) -> subprocess.Popen:
    log = open(logs / f"{name}.log", "ab")
    # Its own process group: Ctrl-C in the terminal reaches us, and we stop each server in order.
    return subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def spawn_mlflow_server(home: Path, port: int) -> subprocess.Popen:
    """An MLflow tracking server on 127.0.0.1:``port`` with its SQLite store and artifacts under ``home/mlflow``."""
    (home / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    store = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    return _spawn("mlflow-server", [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                                    "--workers", "1", "--backend-store-uri", store,
                                    "--artifacts-destination", str(home / "mlflow" / "artifacts")],
                  _home_env(home), home / "logs")


def _prefect(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "prefect"), *args], env={**os.environ, **env}, capture_output=True, text=True)


def ensure_work_pool(pool: str, env: dict[str, str]) -> None:
    """The process work pool, created with Prefect's default job template if missing; concurrency 1."""
    if _prefect(["work-pool", "inspect", pool], env).returncode != 0:
        created = _prefect(["work-pool", "create", pool, "--type", "process"], env)
        if created.returncode != 0 and "already exists" not in created.stdout + created.stderr:
            raise RuntimeError(f"could not create work pool {pool!r}: {created.stdout}{created.stderr}")
    limited = _prefect(["work-pool", "set-concurrency-limit", pool, "1"], env)
    if limited.returncode != 0:
        raise RuntimeError(f"could not limit work pool {pool!r}: {limited.stdout}{limited.stderr}")


def _launch(servers: Servers, name: str) -> subprocess.Popen:
    """Start one of the three processes (again after a crash: the same port, database and log)."""
    logs = servers.home / "logs"
    if name == "prefect-server":
        # The UI's pages call the API at this URL (its default is port 4200 whatever --port says).
        ui_env = {**_home_env(servers.home), "PREFECT_SERVER_UI_API_URL": servers.prefect_url}
        return _spawn(name, [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                             "--port", str(servers.prefect_port)], ui_env, logs)
    if name == "mlflow-server":
        return spawn_mlflow_server(servers.home, servers.mlflow_port)
    return _spawn(name, [str(BIN / "prefect"), "worker", "start", "--pool", servers.pool, "--type", "process",
                         "--limit", "1"], servers.env(), logs)


def _wait_ready(servers: Servers, name: str, process: subprocess.Popen) -> None:
    log = servers.home / "logs" / f"{name}.log"
    if name == "prefect-server":
        wait_healthy(f"{servers.prefect_url}/health", process, "Prefect server", log)
    elif name == "mlflow-server":
        wait_healthy(f"{servers.mlflow_url}/health", process, "MLflow server", log)
    else:
        time.sleep(1.0)
        if process.poll() is not None:
            raise RuntimeError(f"Prefect worker exited with code {process.returncode}; see {log}")


def _write_servers_file(servers: Servers) -> None:
    """``servers.json``, replaced whole: a reader never sees half of it."""
    partial = servers.home / f"{SERVERS_FILE}.partial"
    partial.write_text(json.dumps({"prefect_url": servers.prefect_url, "mlflow_url": servers.mlflow_url,
                                   "pool": servers.pool, "pids": [p.pid for p in servers.processes]}, indent=2))
    partial.replace(servers.home / SERVERS_FILE)


def start(home: Path, prefect_port: int = 4200, mlflow_port: int = 5000, pool: str = WORK_POOL) -> Servers:
    """Start the three processes and return once each answers; on failure, stop what started."""
    home = home.absolute()
    for folder in (home / "logs", home / "prefect", home / "mlflow" / "artifacts"):
        folder.mkdir(parents=True, exist_ok=True)
    servers = Servers(home, f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}", pool,
                      prefect_port, mlflow_port)
    try:
        servers.processes += [_launch(servers, "prefect-server"), _launch(servers, "mlflow-server")]
        for name, process in zip(NAMES, servers.processes):
            _wait_ready(servers, name, process)
        ensure_work_pool(pool, servers.env())
        servers.processes.append(_launch(servers, "prefect-worker"))
        _wait_ready(servers, "prefect-worker", servers.processes[-1])
    except BaseException:
        stop(servers)
        raise
    _write_servers_file(servers)
    return servers


def stop(servers: Servers, timeout: float = 20.0) -> None:
    """Stop the worker first (no new runs), then the servers: SIGTERM to each group, SIGKILL if it lingers."""
    for process in reversed(servers.processes):
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in reversed(servers.processes):
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    (servers.home / SERVERS_FILE).unlink(missing_ok=True)


def running(home: Path) -> dict | None:
    """The servers a ``mintflow serve`` on this home started, if they still answer."""
    path = home.absolute() / SERVERS_FILE
    if not path.is_file():
        return None
    info = json.loads(path.read_text())
    try:
        with urllib.request.urlopen(f"{info['prefect_url']}/health", timeout=2):
            pass
    except OSError:
        return None
    return info


def _say(servers: Servers, message: str) -> None:
    """A line on stderr and in ``logs/serve.log``."""
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} mintflow serve: {message}"
    print(line, file=sys.stderr, flush=True)
    with open(servers.home / "logs" / "serve.log", "a") as log:
        print(line, file=log)


def _restart(servers: Servers, index: int, restarts: list[float]) -> bool:
    """Start a process that died again and record its pid; False, once it died too often."""
    name, dead = NAMES[index], servers.processes[index]
    now = time.monotonic()
    restarts[:] = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
    if len(restarts) > RESTARTS:
        _say(servers, f"{name} (pid {dead.pid}) exited with code {dead.returncode}, {len(restarts)} times in "
                      f"{RESTART_WINDOW_S:.0f} s (at most {RESTARTS} restarts): stopping everything; "
                      f"see {servers.home / 'logs' / name}.log")
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(dead.pid, signal.SIGKILL)  # what it started (uvicorn) dies with it and frees the port
    servers.processes[index] = _launch(servers, name)
    _write_servers_file(servers)
    _say(servers, f"{name} (pid {dead.pid}) exited with code {dead.returncode}; restarted it as pid "
                  f"{servers.processes[index].pid} (restart {len(restarts)}, at most {RESTARTS} in "
                  f"{RESTART_WINDOW_S:.0f} s)")
    try:
        _wait_ready(servers, name, servers.processes[index])
    except RuntimeError as exc:  # the next look finds it dead and restarts it, within the bound
        _say(servers, str(exc))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(servers.processes[index].pid, signal.SIGKILL)
    return True


def serve(home: Path, prefect_port: int, mlflow_port: int) -> None:
    """Start, print the URLs, restart a process that dies, and hold until Ctrl-C or SIGTERM; then stop everything."""
    servers = start(home, prefect_port, mlflow_port)
    stopping = gave_up = False
    restarts: list[list[float]] = [[] for _ in NAMES]  # when each process was last restarted

    def request_stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    print(f"Prefect UI   {servers.prefect_url.removesuffix('/api')}\nMLflow UI    {servers.mlflow_url}\n"
          f"work pool    {servers.pool} (process, concurrency 1)\nhome         {servers.home}\n"
          f"next: mintflow deploy --home {servers.home}    (Ctrl-C stops the servers)", flush=True)
    try:
        while not stopping:
            for index, process in enumerate(servers.processes):
                if not stopping and process.poll() is not None and not _restart(servers, index, restarts[index]):
                    stopping = gave_up = True
            time.sleep(0.5)
    finally:
        stop(servers)
        print("stopped", flush=True)
    if gave_up:
        raise SystemExit(1)
