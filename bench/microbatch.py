"""Micro-batch size for the training forward+backward: time and memory per budget, same run, alternating.

The batch is the reference GRPO step's (issue 4): 8 chat-template prompts x 4 samples, each with
16 response tokens, importance_sampling loss, LoRA r16 on q,k,v,o,gate,up,down, on the embedded
SmolLM2-135M-Instruct. For each token budget (padded tokens per forward+backward pass) it reports
the median seconds of a forward_backward and the peak RSS above the pre-call level (sampled every
5 ms; freed heap is returned to the OS between calls so each call starts from the same floor).

    python bench/microbatch.py [--reps 5] [--budgets 100000 1024 512 256]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """The highest RSS seen while the block runs, sampled on a thread."""

    def __enter__(self):
        self.peak, self._running = _rss_mb(), True
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while self._running:
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budgets", type=int, nargs="+", default=[100_000, 1024, 512, 256])
    args = parser.parse_args()

    import torch
    from engine import _prompts

    import mint
    from mint import types

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    libc = ctypes.CDLL("libc.so.6")
    service = mint.ServiceClient(checkpoint_dir=os.environ.get("BENCH_TMP", "/tmp/mint-bench"))
    tc = service.create_lora_training_client("HuggingFaceTB/SmolLM2-135M-Instruct", rank=16, seed=0)
    tokenizer = tc.get_tokenizer()
    g = torch.Generator().manual_seed(0)
    datums = []
    for prompt in _prompts(tokenizer):
        for _ in range(4):
            seq = prompt + torch.randint(100, len(tokenizer), (16,), generator=g).tolist()
            n, p = len(seq) - 1, len(prompt) - 1
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
                "target_tokens": seq[1:], "weights": [0.0] * p + [1.0] * (n - p), "logprobs": [-2.0] * n,
                "advantages": [0.0] * p + [0.5] * (n - p)}))

    def run(budget: int) -> tuple[float, float]:
        tc.micro_batch_tokens = budget
        libc.malloc_trim(0)
        floor = _rss_mb()
        with PeakRSS() as peak:
            start = time.perf_counter()
            tc.forward_backward(datums, "importance_sampling").result()
            seconds = time.perf_counter() - start
        for p in tc._params:
            p.grad = None
        return seconds, peak.peak - floor

    for budget in args.budgets:
        run(budget)  # warm-up
    results = {b: {"seconds": [], "peak_mb": []} for b in args.budgets}
    for rep in range(args.reps):
        for budget in (args.budgets if rep % 2 == 0 else args.budgets[::-1]):
            seconds, peak = run(budget)
            results[budget]["seconds"].append(seconds)
            results[budget]["peak_mb"].append(peak)
            print(f"rep {rep + 1} budget {budget}: {seconds:.2f} s, +{peak:.0f} MB", file=sys.stderr)
    whole = statistics.median(results[args.budgets[0]]["seconds"])
    summary = {"config": {"reps": args.reps, "sequences": len(datums),
                          "tokens": sum(d.model_input.length for d in datums)},
               "budgets": {str(b): {"median_seconds": statistics.median(r["seconds"]),
                                    "min_seconds": min(r["seconds"]), "max_seconds": max(r["seconds"]),
                                    "median_peak_mb_above_floor": statistics.median(r["peak_mb"]),
                                    "seconds_over_first_budget": statistics.median(r["seconds"]) / whole}
                           for b, r in results.items()}}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
