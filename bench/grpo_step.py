"""Seconds per GRPO iteration, split by stage, and the share spent in Prefect + MLflow.

Runs the same config two ways, each in a fresh subprocess with empty caches, alternating:
  flow: the real product path, `flows.grpo.grpo` (Prefect tasks with caching and result
        persistence, an ephemeral Prefect server, MLflow tracking in SQLite);
  bare: the same task bodies called directly (`task.fn`), no Prefect, no MLflow.
Overhead share = 1 - bare / flow, on the median seconds per iteration (the first
iteration is warm-up and left out).

    python bench/grpo_step.py [--iterations 6] [--reps 2] [--set key=value ...]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The issue-4 reference job: no SFT, lr 1e-4, 8 prompts x 4, 16 tokens, LoRA r16 on attention + MLP.
REFERENCE = ["sft=null", "eval_every=0", "eval_size=50"]


def run_flow(config) -> list[dict]:
    from flows.grpo import grpo

    summary = grpo(config)
    return [{"seconds": h["seconds"], "stages": h["stage_seconds"]} for h in summary["history"][1:]]


def run_bare(config) -> list[dict]:
    from tasks.rollouts import compute_advantages, evaluate, sample, score
    from tasks.train import init_policy, train

    lora = dict(base_model=config.base_model, rank=config.rank, train_unembed=config.train_unembed)
    evaluate_args = dict(dataset=config.dataset, eval_size=config.eval_size, max_tokens=config.max_tokens,
                         reward=config.reward, reward_options=config.reward_options)
    policy = init_policy.fn(seed=config.seed, **lora)
    evaluate.fn(policy, **evaluate_args)
    rows = []
    for iteration in range(1, config.iterations + 1):
        stages = {}
        started = time.perf_counter()

        def timed(task, *args, stages=stages, **kwargs):
            start = time.perf_counter()
            out = task.fn(*args, **kwargs)
            stages[task.name] = time.perf_counter() - start
            return out

        rollouts, _ = timed(sample, policy, dataset=config.dataset, groups_per_batch=config.groups_per_batch,
                            group_size=config.group_size, max_tokens=config.max_tokens,
                            temperature=config.temperature, seed=config.seed, iteration=iteration)
        rewards = timed(score, rollouts, reward=config.reward, reward_options=config.reward_options)
        batch, _ = timed(compute_advantages, rollouts, rewards, base_model=config.base_model,
                         kl_penalty_coef=config.kl_penalty_coef,
                         remove_constant_reward_groups=config.remove_constant_reward_groups)
        policy, _ = timed(train, policy, batch, loss_fn=config.loss_fn, loss_fn_config=config.loss_fn_config,
                          learning_rate=config.learning_rate, grad_clip_norm=config.grad_clip_norm,
                          iteration=iteration, **lora)
        if iteration == config.iterations:
            timed(evaluate, policy, **evaluate_args)
        rows.append({"seconds": time.perf_counter() - started, "stages": stages})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--mode", choices=["flow", "bare"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = REFERENCE + [f"iterations={args.iterations}"] + args.set

    if args.mode:
        from flows.config import build_config

        config = build_config("math", overrides)
        rows = (run_flow if args.mode == "flow" else run_bare)(config)
        print(json.dumps(rows))
        return

    results: dict[str, list[list[dict]]] = {"flow": [], "bare": []}
    for rep in range(args.reps):
        for mode in (("flow", "bare") if rep % 2 == 0 else ("bare", "flow")):
            home = tempfile.mkdtemp(prefix=f"grpo-bench-{mode}-")
            env = {**os.environ, "MINTFLOW_HOME": home, "PREFECT_HOME": f"{home}/prefect", "HF_HUB_OFFLINE": "1",
                   "PREFECT_LOCAL_STORAGE_PATH": f"{home}/prefect/storage", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db"}
            os.makedirs(f"{home}/prefect", exist_ok=True)
            cmd = [sys.executable, __file__, "--mode", mode, "--iterations", str(args.iterations)]
            for item in args.set:
                cmd += ["--set", item]
            try:
                out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
            finally:
                shutil.rmtree(home, ignore_errors=True)
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"rep {rep + 1} {mode}: {[round(r['seconds'], 2) for r in results[mode][-1]]}", file=sys.stderr)

    def per_iteration(mode: str) -> list[float]:
        # Leave out the warm-up iteration, and the last one (it also evaluates).
        return [r["seconds"] for run in results[mode] for r in run[1:-1]]

    def stage_medians(mode: str) -> dict[str, float]:
        names = {k for run in results[mode] for r in run[1:-1] for k in r["stages"]}
        return {k: statistics.median(r["stages"][k] for run in results[mode] for r in run[1:-1] if k in r["stages"])
                for k in sorted(names)}

    flow, bare = statistics.median(per_iteration("flow")), statistics.median(per_iteration("bare"))
    print(json.dumps({
        "config": {"recipe": "math", "overrides": overrides, "reps": args.reps},
        "flow": {"median_s_per_iteration": flow, "min": min(per_iteration("flow")), "max": max(per_iteration("flow")),
                 "stage_seconds": stage_medians("flow")},
        "bare": {"median_s_per_iteration": bare, "min": min(per_iteration("bare")), "max": max(per_iteration("bare")),
                 "stage_seconds": stage_medians("bare")},
        "prefect_mlflow_overhead_share": 1 - bare / flow,
    }, indent=2))


if __name__ == "__main__":
    main()
