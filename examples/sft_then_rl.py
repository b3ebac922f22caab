"""SFT warm start, then GRPO, on 0..20 addition, written against the MinT API only.

The same script runs on the hosted service (``import mint`` there) and here, offline,
on the embedded SmolLM2-135M-Instruct. It prints held-out greedy accuracy before
training, after the SFT warm start, and during RL.

    python examples/sft_then_rl.py --sft-steps 4 --rl-steps 12
"""

from __future__ import annotations

import argparse
import random
import re
import time

from rich.console import Console
from rich.table import Table

import mint
from mint import types

PROMPT = "What is {a} + {b}? Answer with just the number."
console = Console()


def problems(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(n)]


def prompt_tokens(tokenizer, a: int, b: int) -> list[int]:
    messages = [{"role": "user", "content": PROMPT.format(a=a, b=b)}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def reward(text: str, answer: int) -> float:
    """1 if the last integer in the reply is the answer."""
    numbers = re.findall(r"-?\d+", text)
    return float(bool(numbers) and int(numbers[-1]) == answer)


def accuracy(sampler, tokenizer, eval_set) -> float:
    greedy = types.SamplingParams(max_tokens=16, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_tokens(tokenizer, a, b)), 1, greedy)
               for a, b in eval_set]
    replies = [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]
    return sum(reward(r, a + b) for r, (a, b) in zip(replies, eval_set)) / len(eval_set)


def sft_datum(tokenizer, a: int, b: int) -> types.Datum:
    prompt = prompt_tokens(tokenizer, a, b)
    answer = tokenizer.encode(f"{a + b}<|im_end|>", add_special_tokens=False)
    tokens = prompt + answer
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:],
                        "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--sft-steps", type=int, default=4)
    parser.add_argument("--sft-batch", type=int, default=8)
    parser.add_argument("--rl-steps", type=int, default=12)
    parser.add_argument("--groups-per-batch", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--eval-size", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    service = mint.ServiceClient()
    training_client = service.create_lora_training_client(base_model=args.base_model, rank=16, seed=args.seed,
                                                          train_unembed=False)
    tokenizer = training_client.get_tokenizer()
    eval_set = problems(args.eval_size, seed=10_000 + args.seed)
    adam = types.AdamParams(learning_rate=args.learning_rate, grad_clip_norm=1.0)
    rows: list[tuple[str, str, str]] = []

    base_acc = accuracy(service.create_sampling_client(base_model=args.base_model), tokenizer, eval_set)
    rows.append(("base model", "-", f"{base_acc:.2f}"))
    console.print(f"[bold]held-out greedy accuracy of the base model[/]: {base_acc:.2f} on {len(eval_set)} problems")

    # Stage 1: supervised warm start on a few demonstrations of the answer format.
    for step, batch in enumerate(_batches(problems(args.sft_steps * args.sft_batch, seed=args.seed), args.sft_batch)):
        out = training_client.forward_backward([sft_datum(tokenizer, a, b) for a, b in batch], "cross_entropy").result()
        training_client.optim_step(adam).result()
        console.print(f"SFT step {step + 1}/{args.sft_steps}: loss/sequence {out.metrics['loss:sum'] / len(batch):.3f}")
    sft_path = training_client.save_state("sft").result().path
    sampler = training_client.save_weights_and_get_sampling_client("sft-sampler")
    sft_acc = accuracy(sampler, tokenizer, eval_set)
    rows.append(("after SFT", "-", f"{sft_acc:.2f}"))
    console.print(f"[bold]after SFT[/] (checkpoint {sft_path}): accuracy {sft_acc:.2f}")

    # Stage 2: GRPO. Sample a group per prompt, score, center rewards in the group, train.
    rng_problems = problems(args.rl_steps * args.groups_per_batch, seed=1 + args.seed)
    params = types.SamplingParams(max_tokens=16, temperature=0.8)
    for step in range(args.rl_steps):
        start = time.perf_counter()
        batch = rng_problems[step * args.groups_per_batch:(step + 1) * args.groups_per_batch]
        prompts = [prompt_tokens(tokenizer, a, b) for a, b in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group_size, params) for p in prompts]
        datums, rewards_all = [], []
        for prompt, (a, b), future in zip(prompts, batch, futures):
            sequences = future.result().sequences
            rewards = [reward(tokenizer.decode(s.tokens, skip_special_tokens=True), a + b) for s in sequences]
            rewards_all += rewards
            datums += mint.grpo.group_datums(prompt, sequences, rewards)
        training_client.forward_backward(datums, "importance_sampling").result()
        training_client.optim_step(adam).result()
        sampler = training_client.save_weights_and_get_sampling_client()
        mean_reward = sum(rewards_all) / len(rewards_all)
        acc = ""
        if (step + 1) % args.eval_every == 0 or step + 1 == args.rl_steps:
            acc = f"{accuracy(sampler, tokenizer, eval_set):.2f}"
        rows.append((f"RL step {step + 1}", f"{mean_reward:.2f}", acc))
        console.print(f"RL step {step + 1}/{args.rl_steps}: mean reward {mean_reward:.2f}"
                      f"{'  accuracy ' + acc if acc else ''}  ({time.perf_counter() - start:.1f}s)")

    table = Table(title="SFT then GRPO on 0..20 addition (held-out greedy accuracy)")
    for column in ("stage", "mean sampled reward", "held-out accuracy"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _batches(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


if __name__ == "__main__":
    main()
