"""Chat RL with a judge model: does the reward move, and through what?

Runs the chat recipe (recipes/chat.yaml, with any ``--set`` overrides) through the GRPO flow
in a temporary home and prints JSON:
- held out, at each evaluation: the share of instructions followed and the reward;
- sampled, mean over the first and the last ``--window`` iterations: instructions followed,
  the reward, and the judge's own rating read out of the mix,
  (reward - w x instructions) / (1 - w) with w = constraint_weight (exact when every prompt
  carries constraints, as in ``mtbench_if``);
- per instruction, first vs last window: the share of replies that met it (and how many
  replies), and the median reply length in words.

    python bench/chat_reward.py                                  # the recipe as shipped, ~6 min here
    python bench/chat_reward.py --set seed=1
    python bench/chat_reward.py --set reward_options.mode=pairwise
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def by_instruction(rollout_files: list[Path]) -> dict:
    """Share of replies meeting each instruction, and the median reply length, over these iterations."""
    from rewards.judge import check_constraints

    met, words = defaultdict(list), []
    for path in rollout_files:
        for group in json.loads(path.read_text())["groups"]:
            constraints = group["problem"]["constraints"]
            name = " ".join(f"{c['kind']}={c['value']}" if "value" in c else c["kind"] for c in constraints)
            for sample in group["samples"]:
                met[name].append(check_constraints(sample["text"], constraints))
                words.append(len(sample["text"].split()))
    shares = {name: {"share": round(statistics.fmean(v), 2), "replies": len(v)} for name, v in sorted(met.items())}
    return {"met": shares, "median_words": statistics.median(words)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--window", type=int, default=5, help="iterations averaged at the start and at the end")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="mintflow-chat-bench-"))
    os.environ.update(MINTFLOW_HOME=str(home), PREFECT_HOME=str(home / "prefect"), HF_HUB_OFFLINE="1",
                      PREFECT_LOCAL_STORAGE_PATH=str(home / "prefect" / "storage"))
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"):  # a temporary Prefect server, MLflow in the home
        os.environ.pop(name, None)
    sys.path.insert(0, str(ROOT))
    from mlflow.tracking import MlflowClient

    from flows.config import build_config
    from flows.grpo import grpo

    try:
        config = build_config("chat", args.overrides)
        start = time.monotonic()
        summary = grpo(config)
        wall = time.monotonic() - start
        client = MlflowClient(summary["mlflow_tracking_uri"])

        def history(name: str) -> dict[int, float]:
            return {m.step: m.value for m in client.get_metric_history(summary["mlflow_run_id"], name)}

        rollouts = sorted((home / "rollouts").iterdir(), key=lambda p: p.stat().st_mtime)
        if len(rollouts) != config.iterations:
            raise SystemExit(f"expected one rollout file per iteration, found {len(rollouts)} for "
                             f"{config.iterations} iterations")
        followed, reward = history("instructions_followed"), history("reward_mean")
        w = config.reward_options.get("constraint_weight", 0.5)
        first = range(1, args.window + 1)
        last = range(config.iterations - args.window + 1, config.iterations + 1)

        def sampled(steps: range) -> dict[str, float]:
            f, r = statistics.fmean(followed[s] for s in steps), statistics.fmean(reward[s] for s in steps)
            return {"instructions_followed": round(f, 3), "reward": round(r, 3),
                    "judge_rating": round((r - w * f) / (1 - w), 3) if w < 1 else None}

        result = {
            "overrides": args.overrides,
            "flow_seconds": round(wall, 1),
            "held_out": {"instructions_followed": {s: round(v, 3) for s, v in
                                                   history("eval_instructions_followed").items()},
                         "reward": {s: round(v, 3) for s, v in history("eval_reward_mean").items()}},
            f"sampled_iterations_{first.start}_to_{first.stop - 1}": sampled(first),
            f"sampled_iterations_{last.start}_to_{last.stop - 1}": sampled(last),
            "by_instruction": {"first": by_instruction(rollouts[:args.window]),
                               "last": by_instruction(rollouts[-args.window:])},
        }
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
