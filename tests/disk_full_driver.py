"""Runs the tiny GRPO CLI on a disk that fills up mid-run, frees the space, and runs it again.

    bwrap --dev-bind / / --size BYTES --tmpfs DISK -- python tests/disk_full_driver.py DISK LEAVE LOGS

It runs inside bubblewrap's mount namespace, where ``DISK`` is a size-limited tmpfs (SQLite, which
Prefect and MLflow use, needs the real mount: a path through ``/proc/<pid>/root`` resolves to the
host's empty folder). ``$MINTFLOW_HOME`` (Prefect's home and result storage inside it) is
``DISK/home``; a filler file leaves ``LEAVE`` bytes free for the first run. The CLI's output goes to
``LOGS`` (outside the small disk); what the test checks is printed as JSON on the last line.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["iterations=2", "groups_per_batch=2", "group_size=2", "max_tokens=4", "eval_size=4", "eval_every=0",
        "sft.steps=1", "sft.batch_size=2", "seed=21"]


def run_cli(home: Path, log: Path) -> tuple[int, dict | None]:
    """The tiny run with ``home`` as ``$MINTFLOW_HOME``: its exit status and its JSON summary (None if it failed)."""
    command = [sys.executable, "-m", "flows.cli", "run", "math", "--json"]
    for item in ARGS:
        command += ["--set", item]
    env = {**os.environ, "MINTFLOW_HOME": str(home), "PREFECT_HOME": str(home / "prefect"),
           "PREFECT_LOCAL_STORAGE_PATH": str(home / "prefect" / "storage")}
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "MINTFLOW_FAULT"):
        env.pop(key, None)
    with open(log, "w") as err:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=600)
    out = proc.stdout
    return proc.returncode, json.loads(out[out.index("{"):]) if proc.returncode == 0 else None


def checkpoints(home: Path) -> dict:
    """Each entry of the checkpoints folder: "ok" if it verifies, else the error; hidden (temporary) ones listed."""
    from mint.checkpoints import read_manifest

    folder = home / "checkpoints"
    found: dict = {"verified": {}, "hidden": []}
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        if entry.name.startswith("."):
            found["hidden"].append(entry.name)
            continue
        try:
            read_manifest(entry)
            found["verified"][entry.name] = "ok"
        except Exception as e:
            found["verified"][entry.name] = f"{type(e).__name__}: {e}"
    return found


def hidden_files(home: Path) -> list[str]:
    """Temporary files a write left behind anywhere in the home (``.<name>.`` prefixes; SQLite's journals aside)."""
    return sorted(str(p.relative_to(home)) for p in home.rglob(".*"))


def databases(home: Path) -> dict:
    """SQLite's own check of the MLflow and Prefect stores: "ok" for each that is intact."""
    found = {}
    for db in (home / "mlflow.db", home / "prefect" / "prefect.db"):
        if db.is_file():
            with sqlite3.connect(db) as conn:
                found[db.name] = conn.execute("PRAGMA integrity_check").fetchone()[0]
    return found


def history(home: Path) -> list[dict]:
    """Each MLflow run in the home's store: its status and the steps of its metrics."""
    from mlflow.tracking import MlflowClient

    if not (home / "mlflow.db").is_file():
        return []
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mintflow-math")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    return [{"run_id": run.info.run_id, "status": run.info.status,
             **{metric: sorted(m.step for m in client.get_metric_history(run.info.run_id, metric))
                for metric in ("reward_mean", "iteration_done", "eval_accuracy")}} for run in runs]


def uploads(home: Path) -> dict:
    """Each checkpoint folder MLflow holds (logged checkpoints, the final adapter): "ok" if it verifies."""
    from mint.checkpoints import read_manifest

    found = {}
    for manifest in sorted((home / "mlartifacts").rglob("manifest.json")):
        try:
            read_manifest(manifest.parent)
            found[str(manifest.parent.relative_to(home))] = "ok"
        except Exception as e:
            found[str(manifest.parent.relative_to(home))] = f"{type(e).__name__}: {e}"
    return found


def main(disk: Path, leave: int, logs: Path) -> dict:
    home = disk / "home"
    home.mkdir()
    filler = disk / "filler"
    with open(filler, "wb") as f:  # written, not truncated: a sparse file would hold no pages
        block = b"\0" * 2**20
        remaining = shutil.disk_usage(disk).free - leave
        while remaining > 0:
            remaining -= f.write(block[:remaining])
    report: dict = {"free_at_start": shutil.disk_usage(disk).free}
    for name in ("first", "rerun"):
        report[name] = {}
        report[name]["rc"], report[name]["summary"] = run_cli(home, logs / f"{name}.log")
        report[name].update(free=shutil.disk_usage(disk).free, checkpoints=checkpoints(home), hidden=hidden_files(home),
                            databases=databases(home), mlflow_runs=history(home), uploads=uploads(home))
        filler.unlink(missing_ok=True)
    return report


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))))
