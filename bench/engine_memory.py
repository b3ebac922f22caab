"""Resident memory of the bare engine over GRPO steps (no Prefect, no MLflow), under settings given
as environment variables, each in its own process.

The reference job's loop (8 prompts x 4 samples, 16 tokens, importance sampling, Adam 1e-4)
written against the MinT API, as in examples/sft_then_rl.py. Prints JSON: per variant, the
median seconds per step (after 3 warm-up steps) and the current and peak RSS after each step.

    python bench/engine_memory.py --steps 20 --variants "" "ONEDNN_PRIMITIVE_CACHE_CAPACITY=8"
    python bench/engine_memory.py --steps 20 --reps 3 --variants "" "ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024"
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(steps: int) -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from sft_then_rl import problems, prompt_tokens, reward

    import mint
    from mint import types

    torch.set_num_threads(2)
    checkpoints = tempfile.mkdtemp(prefix="engine-memory-")  # ~60 MB a step; removed at the end
    service = mint.ServiceClient(checkpoint_dir=checkpoints)
    client = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=16, seed=0,
                                                 train_unembed=False)
    tokenizer = client.get_tokenizer()
    sampler = client.save_weights_and_get_sampling_client("s0")
    adam = types.AdamParams(learning_rate=1e-4, grad_clip_norm=1.0)
    params = types.SamplingParams(max_tokens=16, temperature=0.8)
    pairs = problems(steps * 8, seed=1)
    seconds, rss, peak = [], [], []
    for step in range(steps):
        start = time.perf_counter()
        batch = pairs[step * 8:(step + 1) * 8]
        prompts = [prompt_tokens(tokenizer, a, b) for a, b in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), 4, params) for p in prompts]
        datums = []
        for prompt, (a, b), future in zip(prompts, batch, futures):
            sequences = future.result().sequences
            rewards = [reward(tokenizer.decode(s.tokens, skip_special_tokens=True), a + b) for s in sequences]
            datums += mint.grpo.group_datums(prompt, sequences, rewards)
        client.forward_backward(datums, "importance_sampling").result()
        client.optim_step(adam).result()
        sampler = client.save_weights_and_get_sampling_client()
        seconds.append(time.perf_counter() - start)
        rss.append(round(int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20))
        peak.append(round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    shutil.rmtree(checkpoints, ignore_errors=True)
    return {"median_s_per_step": statistics.median(seconds[3:]), "rss_mb": rss, "peak_rss_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=["", "ONEDNN_PRIMITIVE_CACHE_CAPACITY=8"],
                        help="space-separated VAR=VALUE settings per variant ('' = unchanged)")
    parser.add_argument("--reps", type=int, default=1, help="runs per variant, alternating between variants")
    parser.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        print(json.dumps(run(args.steps)))
        return
    runs: dict[str, list[dict]] = {variant or "unchanged": [] for variant in args.variants}
    for _ in range(args.reps):
        for variant in args.variants:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2",
                   **dict(item.split("=", 1) for item in variant.split())}
            out = subprocess.run([sys.executable, __file__, "--role", "--steps", str(args.steps)], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True)
            runs[variant or "unchanged"].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {variant: reps[0] if len(reps) == 1 else
               {"median_s_per_step": statistics.median(r["median_s_per_step"] for r in reps), "runs": reps}
               for variant, reps in runs.items()}
    print(json.dumps({"steps": args.steps, "reps": args.reps, "variants": results}, indent=2))


if __name__ == "__main__":
    main()
