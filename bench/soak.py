"""Soak: the math recipe for many iterations on a tiny config, through the real product path
(`mintflow run`: Prefect flow, cached tasks, MLflow), watching for leaks.

Per iteration the flow itself records the process's current and peak RSS, its open file
descriptors and its child processes (MLflow metrics ``rss_mb``, ``peak_rss_mb``, ``open_files``,
``child_processes``). This script runs the CLI in a temporary home, samples the home's disk use
by folder while it runs, and prints JSON: seconds per iteration, RSS after warm-up and at the end
(growth in %), file descriptors and child processes first/last/max, and disk use split into the
policy checkpoints kept on disk (bounded by ``keep_checkpoints``), the checkpoints logged to
MLflow (one per evaluation, by design) and everything else (per iteration).

    python bench/soak.py --iterations 200            # ~10 min here
    python bench/soak.py --iterations 30 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = 10  # iterations before memory is expected to be flat


def folder_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:  # deleted while we walk (retention, temp files)
                pass
    return total


def disk_use(home: Path) -> dict[str, int]:
    """Bytes under the home, split: policy checkpoints, MLflow (store and artifacts), everything else."""
    checkpoints = folder_bytes(home / "checkpoints")
    database = home / "mlflow.db"
    mlflow = folder_bytes(home / "mlartifacts") + (database.stat().st_size if database.exists() else 0)
    return {"checkpoints": checkpoints, "mlflow": mlflow, "other": folder_bytes(home) - checkpoints - mlflow}


def other_breakdown(home: Path) -> dict[str, int]:
    """The "other" bytes by top-level entry of the home (rollouts, datums, prefect, locks, ...)."""
    skip = {"checkpoints", "mlartifacts", "mlflow.db"}
    return {entry.name: folder_bytes(entry) if entry.is_dir() else entry.stat().st_size
            for entry in sorted(home.iterdir()) if entry.name not in skip}


def soak(iterations: int, eval_every: int, keep: int) -> dict:
    home = Path(tempfile.mkdtemp(prefix="mintflow-soak-"))
    settings = [f"iterations={iterations}", "groups_per_batch=2", "group_size=4", "max_tokens=8", "eval_size=8",
                f"eval_every={eval_every}", f"keep_checkpoints={keep}", "sft.steps=2", "sft.batch_size=4"]
    command = [sys.executable, "-m", "flows.cli", "run", "math", "--json"]
    for item in settings:
        command += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))}
    env.update(MINTFLOW_HOME=str(home), PREFECT_HOME=str(home / "prefect"),
               PREFECT_LOCAL_STORAGE_PATH=str(home / "prefect" / "storage"))
    samples: list[dict] = []
    done = threading.Event()

    def watch() -> None:  # disk use every few seconds while the run goes on
        while not done.wait(5.0):
            samples.append({"t": time.monotonic(), **disk_use(home)})

    try:
        watcher = threading.Thread(target=watch, daemon=True)
        start = time.monotonic()
        watcher.start()
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        done.set()
        watcher.join()
        wall = time.monotonic() - start
        if out.returncode != 0:
            raise SystemExit(f"the soak run failed:\n{out.stderr[-4000:]}")
        summary = json.loads(out.stdout[out.stdout.index("{"):])
        final_disk = disk_use(home)
        breakdown = other_breakdown(home)
        prefect = home / "prefect"
        if prefect.is_dir():
            breakdown.update({f"prefect/{k}": v for k, v in other_breakdown(prefect).items()})
        checkpoint_folders = [p for p in (home / "checkpoints").iterdir() if not p.name.startswith(".")]
        leftovers = [p.name for p in (home / "checkpoints").iterdir() if p.name.startswith(".")]
        one_checkpoint = folder_bytes(checkpoint_folders[0]) if checkpoint_folders else 0
        history = _metric_history(summary)
    finally:
        shutil.rmtree(home, ignore_errors=True)

    per_iteration = [h for h in summary["history"] if h["iteration"] >= 1]
    seconds = [h["seconds"] for h in per_iteration]
    rss = history["rss_mb"]
    after_warm_up = rss[min(WARM_UP, len(rss) - 1)]
    mid = len(samples) // 2
    other_rate = ((samples[-1]["other"] - samples[mid]["other"]) / (samples[-1]["t"] - samples[mid]["t"])
                  if len(samples) > 2 else None)
    return {
        "config": settings,
        "wall_seconds": round(wall, 1),
        "seconds_per_iteration": {"median": round(statistics.median(seconds), 3), "min": round(min(seconds), 3),
                                  "max": round(max(seconds), 3)},
        "rss_mb": {"after_warm_up": round(after_warm_up, 1), "last": round(rss[-1], 1), "max": round(max(rss), 1),
                   "growth_after_warm_up_pct": round(100 * (rss[-1] - after_warm_up) / after_warm_up, 2),
                   "every_10th": [round(r, 1) for r in rss[::10]]},
        "peak_rss_mb_last": round(history["peak_rss_mb"][-1], 1),
        "open_files": _first_last_max(history["open_files"]),
        "child_processes": _first_last_max(history["child_processes"]),
        "disk_bytes": {"final": final_disk, "other_by_folder": breakdown, "one_policy_checkpoint": one_checkpoint,
                       "policy_checkpoints_on_disk": len(checkpoint_folders), "half_deleted_leftovers": leftovers,
                       "checkpoints_max_while_running": max((s["checkpoints"] for s in samples), default=0),
                       "other_bytes_per_second_second_half": round(other_rate, 1) if other_rate is not None else None},
        "tasks_ran": summary["tasks_ran"],
    }


def _metric_history(summary: dict) -> dict[str, list[float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary["mlflow_tracking_uri"])
    return {name: [m.value for m in sorted(client.get_metric_history(summary["mlflow_run_id"], name),
                                          key=lambda m: m.step)]
            for name in ("rss_mb", "peak_rss_mb", "open_files", "child_processes")}


def _first_last_max(values: list[float]) -> dict[str, float]:
    return {"first": values[0], "after_warm_up": values[min(WARM_UP, len(values) - 1)], "last": values[-1],
            "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--keep-checkpoints", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    result = soak(args.iterations, args.eval_every, args.keep_checkpoints)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
