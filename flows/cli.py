"""``mintflow``: run a recipe through the GRPO flow, or evaluate a checkpoint.

    mintflow run math [--set learning_rate=5e-5 --set sft.steps=2] [--json]
    mintflow eval CHECKPOINT --recipe math [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def _config(recipe: str, overrides: list[str]):
    from flows.config import build_config

    try:
        return build_config(recipe, overrides)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
                             for err in e.errors())
        raise SystemExit(f"mintflow: invalid config: {problems}") from None
    except ValueError as e:
        raise SystemExit(f"mintflow: {e}") from None


def cmd_run(args: argparse.Namespace) -> int:
    config = _config(args.recipe, args.set)  # validated before any work starts
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

    metrics = evaluate.fn(checkpoint_artifact(args.checkpoint), dataset=config.dataset, eval_size=config.eval_size,
                          max_tokens=config.max_tokens, reward=config.reward, reward_options=config.reward_options)
    print(json.dumps(metrics, indent=2) if args.json else
          f"held-out accuracy {metrics['eval_accuracy']:.3f} on {config.eval_size} problems ({config.dataset})")
    return 0


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
