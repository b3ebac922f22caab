"""mintflow vs TRL's GRPOTrainer vs a plain transformers+peft loop, on the same GRPO job.

The reference job (issue 4): embedded SmolLM2-135M-Instruct in bf16, LoRA r16 alpha 32 on
q,k,v,o,gate,up,down, 8 prompts x group 4, <= 16 new tokens, temperature 0.8 (top_k off,
top_p 1), "What is {a} + {b}? Answer with just the number." through the chat template,
a, b in 0..20, reward 1 if the last integer of the reply is a+b, advantage = reward - group
mean, importance-sampling loss, Adam lr 1e-4, grad clip 1.0, one optimizer step per batch,
no KL, greedy accuracy on a fixed held-out set of 50 problems every 10 steps, 2 torch threads.

mintflow runs the real product path: the Prefect flow with caching, result persistence and
MLflow tracking ON, and under the allocator the mintflow command uses (jemalloc where
installed; MINTFLOW_ALLOCATOR=glibc for glibc's). Each (system, seed) runs in its own
subprocess, in alternating order; s/step excludes the evaluations. Needs the bench extra: pip install -e '.[bench]'.

    python bench/vs_trl.py [--steps 40] [--seeds 0 1 2] [--systems mintflow trl plain]
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
sys.path.insert(0, str(ROOT))
from flows.allocator import jemalloc_env  # noqa: E402

SYSTEMS = ("mintflow", "trl", "plain")
EVAL_EVERY = 10
WARM_UP = 10  # steps left out of the memory trends
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_mintflow(steps: int, seed: int) -> dict:
    from flows.config import build_config
    from flows.grpo import grpo

    config = build_config("math", ["sft=null", f"iterations={steps}", f"eval_every={EVAL_EVERY}", "eval_size=50",
                                   f"seed={seed}", "reward=last_integer", "learning_rate=1e-4", "grad_clip_norm=1.0"])
    summary = grpo(config)
    history = summary["history"]
    seconds = [h["seconds"] - h["stage_seconds"].get("evaluate", 0.0) for h in history[1:]]
    curve = {h["iteration"]: h["eval_accuracy"] for h in history if h["eval_accuracy"] is not None}
    # The flow resets the kernel's high-water mark every iteration, so the process's peak is the
    # larger of the flow's running maximum and what came after the last iteration.
    peak = max(_peak_rss_mb(), max(h["peak_rss_mb"] for h in history))
    return {"seconds_per_step": seconds, "accuracy": curve, "peak_rss_mb": peak,
            "peak_rss_mb_by_step": {h["iteration"]: h["peak_rss_mb"] for h in history[1:] if h["iteration"] % 5 == 0},
            "iteration_peak_rss_mb": [h["iteration_peak_rss_mb"] for h in history[1:]],
            "rss_mb_by_step": {h["iteration"]: h["rss_mb"] for h in history[1:] if h["iteration"] % 5 == 0}}


def _hf_setup(seed: int):
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mint.models import resolve_weights

    torch.manual_seed(seed)
    folder = resolve_weights("HuggingFaceTB/SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    return model, tokenizer, lora


def _greedy_accuracy(model, tokenizer, problems) -> float:
    import torch

    from rewards.math import last_integer_reward

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["question"]}], tokenize=False,
                                           add_generation_prompt=True) for p in problems]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(last_integer_reward(r, p) for r, p in zip(replies, problems)) / len(problems)


def run_trl(steps: int, seed: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards import datasets as problem_sets
    from rewards.math import last_integer_reward

    model, tokenizer, lora = _hf_setup(seed)
    held_out = problem_sets.eval_set("arithmetic", 50)
    train = problem_sets.arithmetic(steps * 8, seed)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p["question"]}], "answer": p["answer"]}
                                 for p in train])

    def reward(completions, answer, **kwargs):
        return [last_integer_reward(c[0]["content"] if isinstance(c, list) else c, {"answer": a})
                for c, a in zip(completions, answer)]

    timings, curve = [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            timings.append(time.perf_counter() - self.start)
            if state.global_step % EVAL_EVERY == 0:
                curve[state.global_step] = _greedy_accuracy(model, tokenizer, held_out)

    output_dir = tempfile.mkdtemp(prefix="trl-", dir=os.environ["MINTFLOW_HOME"])  # removed with the home
    config = GRPOConfig(output_dir=output_dir, learning_rate=1e-4, per_device_train_batch_size=32,
                        num_generations=4, max_completion_length=16, temperature=0.8, top_k=0, top_p=1.0, beta=0.0,
                        loss_type="dapo", scale_rewards="none", max_grad_norm=1.0, bf16=True, use_cpu=True,
                        max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", seed=seed,
                        gradient_accumulation_steps=1, num_iterations=1, disable_dropout=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[Clock()])
    curve[0] = _greedy_accuracy(trainer.model, tokenizer, held_out)
    trainer.train()
    return {"seconds_per_step": timings, "accuracy": dict(sorted(curve.items())), "peak_rss_mb": _peak_rss_mb()}


def run_plain(steps: int, seed: int) -> dict:
    import torch
    from peft import get_peft_model

    from rewards import datasets as problem_sets
    from rewards.math import last_integer_reward

    model, tokenizer, lora = _hf_setup(seed)
    model = get_peft_model(model, lora)
    held_out = problem_sets.eval_set("arithmetic", 50)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95),
                                  eps=1e-12, weight_decay=0.0)
    curve = {0: _greedy_accuracy(model, tokenizer, held_out)}
    timings = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        problems = problem_sets.arithmetic(8, seed * 100_000 + step)
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["question"]}], tokenize=False,
                                               add_generation_prompt=True) for p in problems for _ in range(4)]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=0.8, top_k=0, top_p=1.0, max_new_tokens=16,
                                 return_dict_in_generate=True, output_logits=True,
                                 pad_token_id=tokenizer.pad_token_id)
        prompt_len = batch["input_ids"].shape[1]
        completion = out.sequences[:, prompt_len:]
        is_eos = completion == tokenizer.eos_token_id
        mask = ((is_eos.cumsum(1) - is_eos.long()) == 0).float()  # up to and including the first EOS
        old_lp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, completion[..., None])[..., 0]
        rewards = torch.tensor([last_integer_reward(t, p) for t, p in zip(
            tokenizer.batch_decode(completion, skip_special_tokens=True), [p for p in problems for _ in range(4)])])
        advantages = (rewards.view(8, 4) - rewards.view(8, 4).mean(1, keepdim=True)).view(-1)
        attention = torch.cat([batch["attention_mask"], mask.long()], 1)
        logits = model(input_ids=out.sequences, attention_mask=attention).logits[:, prompt_len - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, completion[..., None])[..., 0]
        ratio = torch.exp((lp - old_lp) * mask)
        loss = -(ratio * advantages[:, None] * mask).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timings.append(time.perf_counter() - start)
        if step % EVAL_EVERY == 0:
            curve[step] = _greedy_accuracy(model, tokenizer, held_out)
    return {"seconds_per_step": timings, "accuracy": curve, "peak_rss_mb": _peak_rss_mb()}


def _trends(result: dict) -> dict[str, dict[str, float]]:
    """Least-squares slope (MiB per step) and its standard error, of resident memory and of each
    step's own peak, from step WARM_UP on: a slope within about two standard errors of zero is no
    trend this run can tell from the step-to-step spread (batch lengths move a step's peak by ~100 MiB)."""
    peaks = result["iteration_peak_rss_mb"][WARM_UP - 1:]
    rss = {int(step): mib for step, mib in result["rss_mb_by_step"].items() if int(step) >= WARM_UP}
    return {"iteration_peak": _slope(list(range(WARM_UP, WARM_UP + len(peaks))), peaks),
            "rss": _slope(list(rss), list(rss.values()))}


def _slope(xs: list[float], ys: list[float]) -> dict[str, float]:
    from scipy.stats import linregress

    fit = linregress(xs, ys)
    return {"slope": round(fit.slope, 2), "standard_error": round(fit.stderr, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--role", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        import torch

        torch.set_num_threads(2)
        fn = {"mintflow": run_mintflow, "trl": run_trl, "plain": run_plain}[args.role]
        print(json.dumps(fn(args.steps, args.seed)))
        return

    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    for i, seed in enumerate(args.seeds):
        order = args.systems[i % len(args.systems):] + args.systems[:i % len(args.systems)]  # rotate who goes first
        for system in order:
            home = tempfile.mkdtemp(prefix=f"vs-trl-{system}-")
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINTFLOW_HOME": home, "PREFECT_HOME": f"{home}/prefect",
                   "PREFECT_LOCAL_STORAGE_PATH": f"{home}/prefect/storage",
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow.db",
                   "OMP_NUM_THREADS": "2"}
            if system == "mintflow":  # the allocator the mintflow command runs with (flows/allocator.py)
                env.update(jemalloc_env(), MINTFLOW_ITERATION_PEAKS="1")  # each iteration's own peak, recorded
            os.makedirs(f"{home}/prefect", exist_ok=True)
            out = subprocess.run([sys.executable, __file__, "--role", system, "--seed", str(seed), "--steps",
                                  str(args.steps)], cwd=ROOT, env=env, capture_output=True, text=True)
            shutil.rmtree(home, ignore_errors=True)  # ~2.5 GB of checkpoints per 40-step run
            if out.returncode != 0:
                raise SystemExit(f"{system} seed {seed} failed:\n{out.stderr[-4000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            result["seed"] = seed
            runs[system].append(result)
            print(f"{system} seed {seed}: median s/step {statistics.median(result['seconds_per_step']):.2f}, "
                  f"accuracy {result['accuracy']}, peak RSS {result['peak_rss_mb']:.0f} MB", file=sys.stderr)

    summary: dict = {"config": {"steps": args.steps, "seeds": args.seeds, "eval_every": EVAL_EVERY}}
    for system, results in runs.items():
        per_step = [s for r in results for s in r["seconds_per_step"][1:]]  # the first step is warm-up
        summary[system] = {
            "s_per_step": {"median": statistics.median(per_step), "min": min(per_step), "max": max(per_step)},
            "accuracy_by_seed": {r["seed"]: r["accuracy"] for r in results},
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "mean_accuracy": {step: statistics.mean(r["accuracy"][step] for r in results)
                              for step in results[0]["accuracy"]},
        }
        if "peak_rss_mb_by_step" in results[0]:
            summary[system]["peak_rss_mb_by_step"] = {r["seed"]: r["peak_rss_mb_by_step"] for r in results}
            summary[system]["rss_mb_by_step"] = {r["seed"]: r["rss_mb_by_step"] for r in results}
            summary[system]["iteration_peak_rss_mb"] = {r["seed"]: r["iteration_peak_rss_mb"] for r in results}
            summary[system]["mib_per_step_after_warm_up"] = {r["seed"]: _trends(r) for r in results}
    if "mintflow" in runs:
        summary["ratios_s_per_step_mintflow_over"] = {
            other: summary["mintflow"]["s_per_step"]["median"] / summary[other]["s_per_step"]["median"]
            for other in runs if other != "mintflow"}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
