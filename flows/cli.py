"""``mintflow``: run a recipe through the GRPO flow, evaluate a checkpoint, serve, deploy, sweep.

    mintflow run math [--set learning_rate=5e-5 --set sft.steps=2] [--json]
    mintflow eval CHECKPOINT --recipe math [--json]
    mintflow serve [--home DIR]          Prefect server + worker + MLflow server on 127.0.0.1
    mintflow deploy [--home DIR]         a deployment per recipe (math: nightly)
    mintflow sweep SWEEP.yaml [--json]   grid or random search, compared in MLflow

run, eval and sweep use the servers of a ``mintflow serve`` on the same home when they are up,
and an ephemeral Prefect with a local SQLite MLflow store otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
                     for err in e.errors())


def _config(recipe: str, overrides: list[str]):
    from flows.config import build_config

    try:
        return build_config(recipe, overrides)
    except ValidationError as e:
        raise SystemExit(f"mintflow: invalid config: {_problems(e)}") from None
    except ValueError as e:
        raise SystemExit(f"mintflow: {e}") from None


def _home(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "home", None) or os.environ.get("MINTFLOW_HOME") or "data").absolute()


def _use_servers(home: Path) -> dict | None:
    """Point this process at the servers of ``mintflow serve`` on ``home`` if they answer (set env wins)."""
    from flows.serve import running, server_env

    info = running(home)
    if info:
        for key, value in server_env(home, info["prefect_url"], info["mlflow_url"]).items():
            os.environ.setdefault(key, value)
    return info


def cmd_serve(args: argparse.Namespace) -> int:
    from flows.serve import serve

    serve(_home(args), args.prefect_port, args.mlflow_port)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    home = _home(args)
    if not _use_servers(home):
        raise SystemExit(f"mintflow deploy: no servers answer for home {home}; start them with "
                         f"`mintflow serve --home {home}`")
    from flows.deploy import deploy

    for name in deploy(args.recipe or None):
        print(f"deployed {name}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from flows.sweep import load_sweep, point_configs

    try:
        spec = load_sweep(args.sweep)
        point_configs(spec)  # every point validated before any run
    except ValidationError as e:
        raise SystemExit(f"mintflow sweep: invalid sweep {args.sweep}: {_problems(e)}") from None
    except ValueError as e:
        raise SystemExit(f"mintflow sweep: {e}") from None
    _use_servers(_home(args))
    from flows.sweep import sweep

    summary = sweep(spec)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    rows = summary["rows"]
    table = Table(title=f"sweep {spec.name}: best by {spec.metric} ({spec.mode})")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()])
    Console().print(table)
    Console().print(f"ran {summary['ran']}, reused {summary['reused']}; best {summary['best']['point']}")
    return 0


MIN_FREE_MB = 64  # below this, Prefect cannot even create its database and fails with a timeout


def _check_free_space(*folders: str | Path) -> None:
    """Refuse to start on a disk that is (nearly) full, naming it, rather than fail obscurely later."""
    import shutil

    for folder in folders:
        existing = Path(folder).absolute()
        while not existing.exists():
            existing = existing.parent
        free = shutil.disk_usage(existing).free / 2**20
        if free < MIN_FREE_MB:
            raise SystemExit(f"mintflow: the disk of {folder} is full ({free:.1f} MiB free, at least {MIN_FREE_MB} "
                             "MiB needed for checkpoints and the Prefect and MLflow stores); free some space")


def cmd_run(args: argparse.Namespace) -> int:
    config = _config(args.recipe, args.set)  # validated before any work starts
    _check_free_space(_home(args), os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")
    _use_servers(_home(args))
    from flows.grpo import grpo

    summary = grpo(config)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    table = Table(title=f"GRPO {config.recipe}: {config.base_model}")
    for column in ("iteration", "mean sampled reward", "held-out accuracy"):
        table.add_column(column, justify="right")
    for row in summary["history"]:
        table.add_row(str(row["iteration"]), "-" if row["mean_reward"] is None else f"{row['mean_reward']:.2f}",
                      "" if row["eval_accuracy"] is None else f"{row['eval_accuracy']:.2f}")
    out = Console()
    out.print(table)
    out.print(f"final checkpoint: {summary['final_checkpoint']}")
    out.print(f"tasks run: {summary['tasks_ran']}, from cache: {summary['tasks_cached']}")
    out.print(f"registered model: {summary['registered_model']} version {summary['registered_version']} "
              f"(alias 'champion')")
    out.print(f"look next: mlflow ui --backend-store-uri {summary['mlflow_tracking_uri']}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    config = _config(args.recipe, args.set)
    from tasks.common import checkpoint_artifact
    from tasks.rollouts import evaluate

    dataset = config.eval_dataset or config.dataset
    metrics = evaluate.fn(checkpoint_artifact(args.checkpoint), dataset=dataset, eval_size=config.eval_size,
                          max_tokens=config.max_tokens, reward=config.reward, reward_options=config.reward_options)
    print(json.dumps(metrics, indent=2) if args.json else
          f"held-out accuracy {metrics['eval_accuracy']:.3f} on {config.eval_size} problems ({dataset})")
    return 0


def cmd_judge_serve(args: argparse.Namespace) -> int:
    from rewards.judge_server import serve

    print(f"judge {args.model} at http://{args.host}:{args.port}/v1 (OpenAI chat completions; Ctrl-C stops)")
    serve(args.model, args.host, args.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command line, not a call from Python: choose the allocator first
        from flows.allocator import use_jemalloc

        use_jemalloc("flows.cli")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded default needs no hub; set 0 to download models
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if os.environ.get("PREFECT_HOME"):  # Prefect creates its home but not the folders above it
        os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
    parser = argparse.ArgumentParser(prog="mintflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a recipe through the GRPO flow")
    run.add_argument("recipe", help="recipe name (recipes/NAME.yaml) or YAML path")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    run.add_argument("--json", action="store_true", help="print a JSON summary")
    run.set_defaults(func=cmd_run)
    ev = sub.add_parser("eval", help="held-out accuracy of a checkpoint")
    ev.add_argument("checkpoint")
    ev.add_argument("--recipe", required=True)
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)
    srv = sub.add_parser("serve", help="Prefect server + process worker + MLflow server on 127.0.0.1")
    srv.add_argument("--home", help="folder for all data (default $MINTFLOW_HOME or ./data)")
    srv.add_argument("--prefect-port", type=int, default=4200)
    srv.add_argument("--mlflow-port", type=int, default=5000)
    srv.set_defaults(func=cmd_serve)
    dep = sub.add_parser("deploy", help="create a Prefect deployment per recipe on the served work pool")
    dep.add_argument("--home")
    dep.add_argument("--recipe", action="append", default=[], help="only these recipes (default all)")
    dep.set_defaults(func=cmd_deploy)
    swp = sub.add_parser("sweep", help="run a sweep file (grid or random search), compared in MLflow")
    swp.add_argument("sweep", help="sweep YAML file")
    swp.add_argument("--home")
    swp.add_argument("--json", action="store_true")
    swp.set_defaults(func=cmd_sweep)
    judge = sub.add_parser("judge-serve", help="serve a local judge model as an OpenAI-compatible endpoint")
    judge.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    judge.add_argument("--host", default="127.0.0.1")
    judge.add_argument("--port", type=int, default=8000)
    judge.set_defaults(func=cmd_judge_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
