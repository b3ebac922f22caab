"""Tasks around rollouts: sample groups, score them, turn them into datums, evaluate a policy."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

from prefect import task

from mint import grpo, types
from mint.checkpoints import failpoint
from rewards import datasets, get_reward, is_group_reward, score_group
from rewards.judge import check_constraints
from tasks.common import (
    REWARD_RETRIES,
    TRANSIENT_RETRIES,
    Artifact,
    content_key,
    derived_seed,
    read_json,
    render_prompt,
    sampling_client,
    service,
    task_cache_key,
    write_json,
)


class RewardError(RuntimeError):
    """A reward function failed on a sample (named in the message)."""


@task(name="sample", cache_key_fn=task_cache_key, persist_result=True, **TRANSIENT_RETRIES)
def sample(policy: Artifact, dataset: str, groups_per_batch: int, group_size: int, max_tokens: int,
           temperature: float, seed: int, iteration: int, prompt_template: str = "{question}",
           sampling_round: int = 0, sampler: str = "transformers",
           gpu_memory_utilization: float = 0.5) -> tuple[Artifact, dict]:
    """``group_size`` samples for each of ``groups_per_batch`` training problems, from the policy checkpoint.

    ``sampling_round`` > 0 draws other problems for the same iteration (DAPO's dynamic sampling).
    """
    key = content_key("sample", dict(locals()))  # = this call's arguments
    sampler = sampling_client(policy.path, sampler, gpu_memory_utilization)
    tokenizer = sampler.get_tokenizer()
    where = (iteration,) if sampling_round == 0 else (iteration, sampling_round)
    problems = datasets.train_batch(dataset, groups_per_batch, derived_seed(seed, "problems", *where))
    start = time.perf_counter()
    prompts = [render_prompt(tokenizer, p["question"], prompt_template) for p in problems]
    futures = [sampler.sample(types.ModelInput.from_ints(prompt), group_size,
                              types.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                   seed=derived_seed(seed, "sample", *where, i)))
               for i, prompt in enumerate(prompts)]
    groups = []
    for problem, prompt, future in zip(problems, prompts, futures):
        samples = [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason,
                    "text": tokenizer.decode(s.tokens, skip_special_tokens=True)} for s in future.result().sequences]
        groups.append({"problem": problem, "prompt_tokens": prompt, "samples": samples})
    seconds = time.perf_counter() - start
    tokens = sum(len(s["tokens"]) for g in groups for s in g["samples"])
    failpoint("sample:sampled")  # every group sampled, nothing written
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
    rewards = []
    for g in range(shard, len(groups), shards):
        rewards.append(_rewards(reward_fn, reward, [s["text"] for s in groups[g]["samples"]], groups[g]["problem"],
                                reward_options, f"group {g}"))
        failpoint("score:scoring")  # after the first group is scored
    return rewards


@task(name="keep_mixed_groups", cache_key_fn=task_cache_key, persist_result=True, **TRANSIENT_RETRIES)
def keep_mixed_groups(rollouts: list[Artifact], rewards: list[list[list[float]]],
                      groups_per_batch: int) -> tuple[Artifact, list[list[float]], dict]:
    """DAPO's dynamic sampling: the first ``groups_per_batch`` groups, over all sampling rounds, whose
    rewards are not all equal; fewer when the rounds ran out (the cap)."""
    key = content_key("keep_mixed_groups", dict(locals()))  # = this call's arguments
    groups, kept_rewards, seen = [], [], 0
    for artifact, round_rewards in zip(rollouts, rewards, strict=True):
        for group, group_rewards in zip(read_json(artifact)["groups"], round_rewards, strict=True):
            seen += 1
            if not grpo.is_constant(group_rewards) and len(groups) < groups_per_batch:
                groups.append(group)
                kept_rewards.append(group_rewards)
    metrics = {"sampling_rounds": len(rollouts), "groups_sampled": seen, "groups_kept": len(groups)}
    return write_json("rollouts", key, {"groups": groups}), kept_rewards, metrics


def _rewards(reward_fn, name: str, texts: list[str], problem: dict, options: dict, where: str) -> list[float]:
    """The rewards of one group, or a RewardError naming the sample (or the group) it failed on."""
    if is_group_reward(reward_fn):
        try:
            return score_group(reward_fn, texts, problem, options)
        except Exception as e:
            raise RewardError(f"reward {name!r} failed on {where} (problem {problem['id']!r}, {len(texts)} "
                              f"replies): {type(e).__name__}: {e}") from e
    return [_reward(reward_fn, name, text, problem, options, f"{where} sample {i}") for i, text in enumerate(texts)]


def _reward(reward_fn, name: str, text: str, problem: dict, options: dict, where: str) -> float:
    """One reward, or a RewardError naming the sample it failed on."""
    try:
        return float(reward_fn(text, problem, **options))
    except Exception as e:
        raise RewardError(f"reward {name!r} failed on {where} (problem {problem['id']!r}, completion "
                          f"{text[:80]!r}): {type(e).__name__}: {e}") from e


@task(name="compute_advantages", cache_key_fn=task_cache_key, persist_result=True, **TRANSIENT_RETRIES)
def compute_advantages(rollouts: Artifact, rewards: list[list[float]], base_model: str, kl_penalty_coef: float,
                       remove_constant_reward_groups: bool, max_tokens: int = 0, overlong_cache: int = 0,
                       overlong_penalty_factor: float = 1.0, loss_normalization: str = "sum") -> tuple[Artifact, dict]:
    """GRPO datums: advantage = reward - group mean; KL to the base model folded in when the coefficient > 0."""
    key = content_key("compute_advantages", dict(locals()))  # = this call's arguments
    groups = read_json(rollouts)["groups"]
    metrics = reward_metrics(rewards) if rewards else {}
    followed = instructions_followed((g["problem"], s["text"]) for g in groups for s in g["samples"])
    if followed:
        metrics["instructions_followed"] = statistics.fmean(followed)
    if overlong_cache:  # DAPO's soft overlong punishment, added to the task reward before the group baseline
        penalties = [[grpo.overlong_penalty(len(s["tokens"]), max_tokens, overlong_cache, overlong_penalty_factor)
                      for s in group["samples"]] for group in groups]
        rewards = [[r + p for r, p in zip(rs, ps)] for rs, ps in zip(rewards, penalties)]
        metrics["overlong_penalty_mean"] = statistics.fmean([p for ps in penalties for p in ps]) if groups else 0.0
    datums = []
    for group, group_rewards in zip(groups, rewards, strict=True):
        if remove_constant_reward_groups and grpo.is_constant(group_rewards):
            continue
        samples = [types.SampledSequence(tokens=s["tokens"], logprobs=s["logprobs"], stop_reason=s["stop_reason"])
                   for s in group["samples"]]
        datums += grpo.group_datums(group["prompt_tokens"], samples, group_rewards)
    if kl_penalty_coef > 0 and datums:
        reference = service().create_sampling_client(base_model=base_model)
        futures = [reference.compute_logprobs(types.ModelInput.from_ints(
            d.model_input.to_ints() + d.loss_fn_inputs["target_tokens"].tolist()[-1:])) for d in datums]
        reference_lp = [f.result()[1:] for f in futures]
        datums, metrics["kl_to_base"] = grpo.incorporate_kl_penalty(datums, reference_lp, kl_penalty_coef)
    datums = grpo.normalize_advantages(datums, loss_normalization)
    metrics["num_datums"] = len(datums)
    failpoint("compute_advantages:computed")
    return write_json("datums", key, {"datums": [d.model_dump() for d in datums]}), metrics


def instructions_followed(replies: Iterable[tuple[dict, str]]) -> list[float]:
    """For each (problem, reply) whose problem carries IFEval-style ``constraints``, the share of
    them the reply meets. Logged apart from the reward: mixed with a judge's verdict (a pairwise
    win rate averages 0.5 in every group), the part that can be checked would be hard to read."""
    return [check_constraints(text, problem["constraints"]) for problem, text in replies if problem.get("constraints")]


def reward_metrics(rewards: list[list[float]]) -> dict:
    """Mean and spread of the rewards, and the shares of groups with mixed, all-good and all-bad rewards."""
    flat = [r for row in rewards for r in row]
    constant = [row for row in rewards if grpo.is_constant(row)]
    n = len(rewards)
    return {"reward_mean": statistics.fmean(flat), "reward_std": statistics.pstdev(flat),
            "frac_mixed": 1 - len(constant) / n,
            "frac_all_good": sum(1 for row in constant if row[0] > 0) / n,
            "frac_all_bad": sum(1 for row in constant if row[0] <= 0) / n}


@task(name="evaluate", cache_key_fn=task_cache_key, persist_result=True, **REWARD_RETRIES)
def evaluate(policy: Artifact, dataset: str, eval_size: int, max_tokens: int, reward: str, reward_options: dict,
             prompt_template: str = "{question}", samples: int = 1, temperature: float = 1.0, seed: int = 0,
             sampler: str = "transformers", gpu_memory_utilization: float = 0.5) -> dict:
    """Held-out accuracy: greedy with ``samples`` = 1; else avg@k (mean accuracy of k samples at
    ``temperature``) and pass@k (share of problems with at least one correct sample).

    Correct means a full reward of 1 (verified answer, every test passed) without shaping
    (a format bonus); the mean reward is reported too.
    """
    sampler = sampling_client(policy.path, sampler, gpu_memory_utilization)
    tokenizer = sampler.get_tokenizer()
    problems = datasets.eval_set(dataset, eval_size)
    start = time.perf_counter()
    futures = []
    for i, p in enumerate(problems):
        params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0) if samples == 1 else \
            types.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=derived_seed(seed, "eval", i))
        prompt = render_prompt(tokenizer, p["question"], prompt_template)
        futures.append(sampler.sample(types.ModelInput.from_ints(prompt), samples, params))
    reward_fn = get_reward(reward)
    shaping = set(getattr(reward_fn, "shaping_options", ())) & set(reward_options)
    unshaped = {k: v for k, v in reward_options.items() if k not in shaping}
    scores, correct, followed = [], [], []
    for i, (p, future) in enumerate(zip(problems, futures)):
        texts = [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in future.result().sequences]
        followed += instructions_followed((p, t) for t in texts)
        # One reply at a time: a group reward (a judge) grades each reply on its own here.
        problem_scores = [_rewards(reward_fn, reward, [t], p, reward_options, f"eval problem {i}")[0] for t in texts]
        plain = problem_scores if not shaping else [
            _rewards(reward_fn, reward, [t], p, unshaped, f"eval problem {i}")[0] for t in texts]
        scores += problem_scores
        correct.append([score >= 1.0 for score in plain])
        failpoint("evaluate:scoring")  # after the first problem is scored
    metrics = {"eval_accuracy": statistics.fmean(c for row in correct for c in row),
               "eval_reward_mean": statistics.fmean(scores), "eval_seconds": time.perf_counter() - start}
    if followed:
        metrics["eval_instructions_followed"] = statistics.fmean(followed)
    if samples > 1:
        metrics[f"eval_avg_at_{samples}"] = metrics["eval_accuracy"]
        metrics[f"eval_pass_at_{samples}"] = statistics.fmean(any(row) for row in correct)
    return metrics
