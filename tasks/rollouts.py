"""Tasks around rollouts: sample groups, score them, turn them into datums, evaluate a policy."""

from __future__ import annotations

import statistics
import time

from prefect import task

from mint import grpo, types
from rewards import datasets, get_reward
from tasks.common import (
    REWARD_RETRIES,
    TRANSIENT_RETRIES,
    Artifact,
    content_key,
    derived_seed,
    read_json,
    render_prompt,
    service,
    task_cache_key,
    write_json,
)


class RewardError(RuntimeError):
    """A reward function failed on a sample (named in the message)."""


@task(name="sample", cache_key_fn=task_cache_key, persist_result=True, **TRANSIENT_RETRIES)
def sample(policy: Artifact, dataset: str, groups_per_batch: int, group_size: int, max_tokens: int,
           temperature: float, seed: int, iteration: int) -> tuple[Artifact, dict]:
    """``group_size`` samples for each of ``groups_per_batch`` training problems, from the policy checkpoint."""
    key = content_key("sample", dict(locals()))  # = this call's arguments
    sampler = service().create_sampling_client(model_path=policy.path)
    tokenizer = sampler.get_tokenizer()
    problems = datasets.train_batch(dataset, groups_per_batch, derived_seed(seed, "problems", iteration))
    start = time.perf_counter()
    prompts = [render_prompt(tokenizer, p["question"]) for p in problems]
    futures = [sampler.sample(types.ModelInput.from_ints(prompt), group_size,
                              types.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                   seed=derived_seed(seed, "sample", iteration, i)))
               for i, prompt in enumerate(prompts)]
    groups = []
    for problem, prompt, future in zip(problems, prompts, futures):
        samples = [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason,
                    "text": tokenizer.decode(s.tokens, skip_special_tokens=True)} for s in future.result().sequences]
        groups.append({"problem": problem, "prompt_tokens": prompt, "samples": samples})
    seconds = time.perf_counter() - start
    tokens = sum(len(s["tokens"]) for g in groups for s in g["samples"])
    return write_json("rollouts", key, {"groups": groups}), {"sample_seconds": seconds, "sampled_tokens": tokens,
                                                               "sample_tokens_per_s": tokens / max(seconds, 1e-9)}




@task(name="score", cache_key_fn=task_cache_key, persist_result=True, **REWARD_RETRIES)
def score(rollouts: Artifact, reward: str, reward_options: dict, shard: int = 0, shards: int = 1) -> list[list[float]]:
    """Rewards per sample of the groups ``shard, shard + shards, ...`` (all of them by default).

    Shards let a flow fan scoring out over a task runner; retried with backoff, because
    judges and sandboxes fail transiently.
    """
    reward_fn = get_reward(reward)
    groups = read_json(rollouts)["groups"]
    return [[_reward(reward_fn, reward, s["text"], groups[g]["problem"], reward_options, f"group {g} sample {i}")
             for i, s in enumerate(groups[g]["samples"])]
            for g in range(shard, len(groups), shards)]


def _reward(reward_fn, name: str, text: str, problem: dict, options: dict, where: str) -> float:
    """One reward, or a RewardError naming the sample it failed on."""
    try:
        return float(reward_fn(text, problem, **options))
    except Exception as e:
        raise RewardError(f"reward {name!r} failed on {where} (problem {problem['id']!r}, completion "
                          f"{text[:80]!r}): {type(e).__name__}: {e}") from e


@task(name="compute_advantages", cache_key_fn=task_cache_key, persist_result=True, **TRANSIENT_RETRIES)
def compute_advantages(rollouts: Artifact, rewards: list[list[float]], base_model: str, kl_penalty_coef: float,
                       remove_constant_reward_groups: bool) -> tuple[Artifact, dict]:
    """GRPO datums: advantage = reward - group mean; KL to the base model folded in when the coefficient > 0."""
    key = content_key("compute_advantages", dict(locals()))  # = this call's arguments
    groups = read_json(rollouts)["groups"]
    datums = []
    constant = 0
    for group, group_rewards in zip(groups, rewards, strict=True):
        if grpo.is_constant(group_rewards):
            constant += 1
            if remove_constant_reward_groups:
                continue
        samples = [types.SampledSequence(tokens=s["tokens"], logprobs=s["logprobs"], stop_reason=s["stop_reason"])
                   for s in group["samples"]]
        datums += grpo.group_datums(group["prompt_tokens"], samples, group_rewards)
    metrics = _reward_metrics(rewards)
    if kl_penalty_coef > 0 and datums:
        reference = service().create_sampling_client(base_model=base_model)
        futures = [reference.compute_logprobs(types.ModelInput.from_ints(
            d.model_input.to_ints() + d.loss_fn_inputs["target_tokens"].tolist()[-1:])) for d in datums]
        reference_lp = [f.result()[1:] for f in futures]
        datums, metrics["kl_to_base"] = grpo.incorporate_kl_penalty(datums, reference_lp, kl_penalty_coef)
    metrics["num_datums"] = len(datums)
    return write_json("datums", key, {"datums": [d.model_dump() for d in datums]}), metrics


def _reward_metrics(rewards: list[list[float]]) -> dict:
    flat = [r for row in rewards for r in row]
    constant = [row for row in rewards if grpo.is_constant(row)]
    n = len(rewards)
    return {"reward_mean": statistics.fmean(flat), "reward_std": statistics.pstdev(flat),
            "frac_mixed": 1 - len(constant) / n,
            "frac_all_good": sum(1 for row in constant if row[0] > 0) / n,
            "frac_all_bad": sum(1 for row in constant if row[0] <= 0) / n}


@task(name="evaluate", cache_key_fn=task_cache_key, persist_result=True, **REWARD_RETRIES)
def evaluate(policy: Artifact, dataset: str, eval_size: int, max_tokens: int, reward: str,
             reward_options: dict) -> dict:
    """Greedy accuracy (reward > 0 counts as correct for 0/1 rewards: mean reward is also reported)."""
    sampler = service().create_sampling_client(model_path=policy.path)
    tokenizer = sampler.get_tokenizer()
    problems = datasets.eval_set(dataset, eval_size)
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    futures = [sampler.sample(types.ModelInput.from_ints(render_prompt(tokenizer, p["question"])), 1, greedy)
               for p in problems]
    reward_fn = get_reward(reward)
    texts = [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]
    scores = [_reward(reward_fn, reward, t, p, reward_options, f"eval problem {i}")
              for i, (t, p) in enumerate(zip(texts, problems))]
    # Accuracy ignores any format bonus: correct means the verifier accepted the answer.
    correct = [_reward(reward_fn, reward, t, p, {}, f"eval problem {i}") > 0
               for i, (t, p) in enumerate(zip(texts, problems))]
    return {"eval_accuracy": sum(correct) / len(problems), "eval_reward_mean": statistics.fmean(scores),
            "eval_seconds": time.perf_counter() - start}
