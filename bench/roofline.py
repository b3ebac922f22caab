"""How close the engine runs to this machine's matmul peak.

1. Peak: the best GFLOP/s of square matmuls (bf16 and fp32) on the benchmark's thread count.
2. The engine's two phases on the reference job (as in bench/engine.py), with their FLOPs
   counted from the model's shapes and the tokens actually processed:
   - train: forward + backward of 32 x 47 tokens. Linear layers cost 2*N*params forward and
     2*N*params backward (input gradients only: the base is frozen; LoRA adds ~1%), N being
     the positions the body really runs (each group's shared prompt once, padding included);
     the unembedding costs 2*T*H*V forward on all T tokens plus 2*n*H*V backward on the n
     weighted positions.
   - sample: one prefill of the 8 prompts, then one decode step per generated token, each
     2*params per row plus the unembedding of that row.
   Attention score FLOPs are left out (under 2% at these lengths).

    python bench/roofline.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine  # noqa: E402  (the same jobs as bench/engine.py)

THREADS = int(os.environ.get("BENCH_THREADS", "2"))


def matmul_peak(dtype: torch.dtype, sizes=(1024, 2048, 3072), repeats: int = 5) -> float:
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


def main() -> None:
    torch.set_num_threads(THREADS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    peaks = {"bfloat16": matmul_peak(torch.bfloat16), "float32": matmul_peak(torch.float32)}

    import mint
    from mint import types
    from mint.prefix import layout, shared_prompt_lengths

    service = mint.ServiceClient(checkpoint_dir="/tmp/mint-roofline")
    tc = service.create_lora_training_client("HuggingFaceTB/SmolLM2-135M-Instruct", rank=16, seed=0,
                                             train_unembed=False)
    model = tc.base.model
    hidden, vocab = model.config.hidden_size, tc.base.vocab_size
    body_params = sum(p.numel() for n, p in model.named_parameters()
                      if "layers." in n and p.dim() == 2 and ".lora_" not in n)
    tokenizer = tc.get_tokenizer()
    prompts = engine._prompts(tokenizer)

    seqs = engine._train_batch(prompts, len(tokenizer))
    datums = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={
        "target_tokens": s[1:], "weights": [0.0] * 31 + [1.0] * 16, "logprobs": [-2.0] * 47,
        "advantages": [0.0] * 31 + [0.5] * 16}) for s in seqs]
    n_tokens, n_weighted = 32 * 47, 32 * 16
    # The body runs each group's shared prompt once (mint.prefix): count the positions it really runs.
    inputs = [d.model_input.to_ints() for d in datums]
    shared = layout(inputs, shared_prompt_lengths(inputs, [d.loss_fn_inputs["weights"].to_torch() for d in datums]))
    n_body = shared.padded_tokens
    train_flops = 4 * n_body * body_params + 2 * n_tokens * hidden * vocab + 2 * n_weighted * hidden * vocab
    train_seconds = []
    for i in range(4):
        start = time.perf_counter()
        tc.forward_backward(datums, "importance_sampling").result()
        if i:
            train_seconds.append(time.perf_counter() - start)
        for p in tc._params:
            p.grad = None

    sampler = tc.save_weights_and_get_sampling_client("roofline")
    params = types.SamplingParams(max_tokens=16, temperature=0.8)
    sample_seconds, sample_flops = [], []
    for i in range(4):
        start = time.perf_counter()
        futures = [sampler.sample(types.ModelInput.from_ints(p), 4, params) for p in prompts]
        generated = [len(s.tokens) for f in futures for s in f.result().sequences]
        if i:
            sample_seconds.append(time.perf_counter() - start)
            prefill = sum(len(p) for p in prompts)
            sample_flops.append(2 * (prefill + sum(generated)) * body_params + 2 * (len(prompts) + sum(generated))
                                * hidden * vocab)

    def phase(flops: float, seconds: float) -> dict:
        achieved = flops / seconds / 1e9
        return {"gflop": flops / 1e9, "median_seconds": seconds, "achieved_gflops": achieved,
                "fraction_of_bf16_peak": achieved / peaks["bfloat16"]}

    print(json.dumps({
        "threads": THREADS,
        "matmul_peak_gflops": peaks,
        "model": {"body_linear_params": body_params, "hidden": hidden, "vocab": vocab},
        "train": {**phase(train_flops, statistics.median(train_seconds)), "tokens": n_tokens,
                  "body_positions_run": n_body},
        "sample": phase(statistics.median(sample_flops), statistics.median(sample_seconds)),
    }, indent=2))


if __name__ == "__main__":
    main()
