"""Reward functions, looked up by name.

A reward scores one reply, ``(completion, problem, **options) -> float``, or, marked with
``group_reward = True``, a whole group at once, ``(completions, problem, **options) -> list[float]``
(a judge comparing the replies of a group), called through ``score_group``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rewards.code import code_reward
from rewards.judge import judge_group_reward
from rewards.math import last_integer_reward, math_reward

RewardFn = Callable[..., float]

REWARDS: dict[str, Callable] = {"math": math_reward, "last_integer": last_integer_reward, "code": code_reward,
                                "judge": judge_group_reward}


def get_reward(name: str) -> Callable:
    if name not in REWARDS:
        raise ValueError(f"reward: unknown reward {name!r}; expected one of {sorted(REWARDS)}")
    return REWARDS[name]


def is_group_reward(reward_fn: Callable) -> bool:
    return getattr(reward_fn, "group_reward", False)


def score_group(reward_fn: Callable, completions: Sequence[str], problem: dict, options: dict) -> list[float]:
    """A group reward's scores for one group of replies to ``problem``, one per reply."""
    scores = [float(s) for s in reward_fn(list(completions), problem, **options)]
    if len(scores) != len(completions):
        raise ValueError(f"group reward returned {len(scores)} scores for {len(completions)} replies")
    return scores
