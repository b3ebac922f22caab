"""Service mode: a Prefect server, a process worker and an MLflow tracking server, on 127.0.0.1.

    mintflow serve [--home DIR] [--prefect-port 4200] [--mlflow-port 5000]

Everything lives under one folder (``--home``, default ``$MINTFLOW_HOME`` or ./data):
``prefect/`` (the Prefect database and persisted task results), ``mlflow/`` (``mlflow.db``
and the artifact store), and the pipeline's own files (checkpoints, rollouts). The worker
polls the ``mintflow`` process work pool, created if missing with a concurrency limit of 1:
one training run at a time on this machine. ``servers.json`` in the home tells other
commands (``mintflow deploy``, ``mintflow sweep``) where the servers are. Ctrl-C stops all three.
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


@dataclass
class Servers:
    home: Path
    prefect_url: str
    mlflow_url: str
    pool: str = WORK_POOL
    processes: list[subprocess.Popen] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """What a process needs to use these servers (the worker passes it on to every flow run)."""
        return server_env(self.home, self.prefect_url, self.mlflow_url)


def server_env(home: Path, prefect_url: str, mlflow_url: str) -> dict[str, str]:
    return {**_home_env(home), "PREFECT_API_URL": prefect_url, "MLFLOW_TRACKING_URI": mlflow_url}


def _home_env(home: Path) -> dict[str, str]:
    return {"MINTFLOW_HOME": str(home), "PREFECT_HOME": str(home / "prefect"),
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


def start(home: Path, prefect_port: int = 4200, mlflow_port: int = 5000, pool: str = WORK_POOL) -> Servers:
    """Start the three processes and return once each answers; on failure, stop what started."""
    home = home.absolute()
    logs = home / "logs"
    for folder in (logs, home / "prefect", home / "mlflow" / "artifacts"):
        folder.mkdir(parents=True, exist_ok=True)
    servers = Servers(home, f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}", pool)
    try:
        # The UI's pages call the API at this URL (its default is port 4200 whatever --port says).
        ui_env = {**_home_env(home), "PREFECT_SERVER_UI_API_URL": servers.prefect_url}
        prefect = _spawn("prefect-server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                            "--port", str(prefect_port)], ui_env, logs)
        servers.processes.append(prefect)
        mlflow = spawn_mlflow_server(home, mlflow_port)
        servers.processes.append(mlflow)
        wait_healthy(f"{servers.prefect_url}/health", prefect, "Prefect server", logs / "prefect-server.log")
        wait_healthy(f"{servers.mlflow_url}/health", mlflow, "MLflow server", logs / "mlflow-server.log")
        ensure_work_pool(pool, servers.env())
        worker = _spawn("prefect-worker", [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type",
                                           "process", "--limit", "1"], servers.env(), logs)
        servers.processes.append(worker)
        time.sleep(1.0)
        if worker.poll() is not None:
            raise RuntimeError(f"Prefect worker exited with code {worker.returncode}; "
                               f"see {logs / 'prefect-worker.log'}")
    except BaseException:
        stop(servers)
        raise
    (home / SERVERS_FILE).write_text(json.dumps(
        {"prefect_url": servers.prefect_url, "mlflow_url": servers.mlflow_url, "pool": pool,
         "pids": [p.pid for p in servers.processes]}, indent=2))
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


def serve(home: Path, prefect_port: int, mlflow_port: int) -> None:
    """Start, print the URLs, and hold until Ctrl-C or SIGTERM; then stop everything."""
    servers = start(home, prefect_port, mlflow_port)
    stopping = False

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
            for process in servers.processes:
                if process.poll() is not None:
                    print(f"a server process exited (code {process.returncode}); see {servers.home / 'logs'}",
                          file=sys.stderr)
                    stopping = True
            time.sleep(0.5)
    finally:
        stop(servers)
        print("stopped", flush=True)
