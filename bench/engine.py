"""Engine benchmark: mint vs a plain transformers+peft loop, same jobs, same run, alternating.

Jobs (the GRPO step's two halves, on the embedded SmolLM2-135M-Instruct, bf16 where supported):
  sample: 8 prompts x 4 samples x up to 16 new tokens, temperature 0.8, with per-token logprobs
  train:  forward+backward of the importance_sampling loss over 32 sequences x 48 tokens, LoRA r16
          on q,k,v,o,gate,up,down (alpha 32)

Each repetition runs every system in a fresh subprocess (so peak RSS is its own), in
alternating order, and reports the median of its timed iterations; the summary gives the
median over repetitions, and mint/plain speed ratios (> 1 means mint is faster).

    python bench/engine.py [--reps 3] [--iters 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

PROMPT = "What is {a} + {b}? Answer with just the number."
SYSTEMS = ("mint", "plain")


def _problems(n, seed=0):
    rng = random.Random(seed)
    return [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(n)]


def _prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": PROMPT.format(a=a, b=b)}],
                                          add_generation_prompt=True, return_dict=False) for a, b in _problems(8)]


def _train_batch(prompts, vocab, seed=0):
    """32 sequences: each prompt (padded/cut to 32 tokens) + 16 random response tokens = 48 tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(32):
        prompt = (prompts[i % len(prompts)] * 2)[:32]
        response = torch.randint(100, vocab, (16,), generator=g).tolist()
        seqs.append(prompt + response)
    return seqs


def run_mint(iters: int) -> dict:
    import torch

    import mint
    from mint import types

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    service = mint.ServiceClient(checkpoint_dir=os.environ.get("BENCH_TMP", "/tmp/mint-bench"))
    tc = service.create_lora_training_client("HuggingFaceTB/SmolLM2-135M-Instruct", rank=16, seed=0,
                                             train_unembed=False)
    tokenizer = tc.get_tokenizer()
    prompts = _prompts(tokenizer)
    sampler = tc.save_weights_and_get_sampling_client("bench")
    params = types.SamplingParams(max_tokens=16, temperature=0.8)

    def sample_job():
        futures = [sampler.sample(types.ModelInput.from_ints(p), 4, params) for p in prompts]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    seqs = _train_batch(prompts, len(tokenizer))
    datums = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={
        "target_tokens": s[1:], "weights": [0.0] * 31 + [1.0] * 16, "logprobs": [-2.0] * 47,
        "advantages": [0.0] * 31 + [0.5] * 16}) for s in seqs]

    def train_job():
        tc.forward_backward(datums, "importance_sampling").result()
        for p in tc._params:
            p.grad = None
        return 32 * 47

    return _time_jobs(sample_job, train_job, iters)


def run_plain(iters: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mint.models import resolve_weights

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    folder = resolve_weights("HuggingFaceTB/SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    prompts = _prompts(tokenizer)
    texts = [tokenizer.decode(p) for p in prompts for _ in range(4)]

    def sample_job():
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=0.8, top_k=0, top_p=1.0, max_new_tokens=16,
                                 return_dict_in_generate=True, output_logits=True,
                                 pad_token_id=tokenizer.pad_token_id)
        new = out.sequences[:, batch["input_ids"].shape[1]:]
        logits = torch.stack(out.logits, dim=1).float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, new[..., None]).squeeze(-1)
        done = (new == tokenizer.eos_token_id).cumsum(1) - (new == tokenizer.eos_token_id).long() > 0
        del logprobs
        return int((~done).sum())

    seqs = _train_batch(prompts, len(tokenizer))
    ids = torch.tensor([s[:-1] for s in seqs])
    targets = torch.tensor([s[1:] for s in seqs])
    weights = torch.tensor([[0.0] * 31 + [1.0] * 16] * 32)
    adv = weights * 0.5
    old = torch.full_like(weights, -2.0)

    def train_job():
        model.train()
        logits = model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
        ratio = torch.exp(torch.where(weights > 0, lp - old, torch.zeros_like(lp)))
        loss = -(ratio * adv * weights).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return 32 * 47

    return _time_jobs(sample_job, train_job, iters)


def _time_jobs(sample_job, train_job, iters: int) -> dict:
    result = {}
    for name, job in (("sample", sample_job), ("train", train_job)):
        job()  # warm-up
        seconds, tokens = [], []
        for _ in range(iters):
            start = time.perf_counter()
            tokens.append(job())
            seconds.append(time.perf_counter() - start)
        result[name] = {"seconds": statistics.median(seconds), "tokens": statistics.median(tokens),
                        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds))}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--role", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        print(json.dumps({"mint": run_mint, "plain": run_plain}[args.role](args.iters)))
        return

    runs = {s: [] for s in SYSTEMS}
    for rep in range(args.reps):
        for system in (SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]):
            out = subprocess.run([sys.executable, __file__, "--role", system, "--iters", str(args.iters)],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1"})
            runs[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"rep {rep + 1}/{args.reps} {system}: {runs[system][-1]}", file=sys.stderr)

    def med(system, job, key):
        return statistics.median(r[job][key] for r in runs[system])

    summary = {"config": {"reps": args.reps, "iters": args.iters, "threads": int(os.environ.get("BENCH_THREADS", 2)),
                          "sample_job": "8 prompts x 4 samples x <=16 tokens, T=0.8",
                          "train_job": "forward+backward, 32 x 48 tokens, LoRA r16 (attn+mlp)"}}
    for system in SYSTEMS:
        summary[system] = {
            job: {"median_seconds": med(system, job, "seconds"),
                  "median_tokens_per_s": med(system, job, "tokens_per_s"),
                  "min_seconds": min(r[job]["seconds"] for r in runs[system]),
                  "max_seconds": max(r[job]["seconds"] for r in runs[system])}
            for job in ("sample", "train")}
        summary[system]["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs[system])
    summary["ratios_mint_over_plain"] = {
        "sample_tokens_per_s": med("mint", "sample", "tokens_per_s") / med("plain", "sample", "tokens_per_s"),
        "sample_seconds_speedup": med("plain", "sample", "seconds") / med("mint", "sample", "seconds"),
        "train_tokens_per_s": med("mint", "train", "tokens_per_s") / med("plain", "train", "tokens_per_s"),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
