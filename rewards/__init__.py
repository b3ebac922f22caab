"""Reward functions: ``(completion, example, **options) -> float``, looked up by name."""

from __future__ import annotations

from collections.abc import Callable

from rewards.math import last_integer_reward, math_reward

RewardFn = Callable[..., float]

REWARDS: dict[str, RewardFn] = {"math": math_reward, "last_integer": last_integer_reward}


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"reward: unknown reward {name!r}; expected one of {sorted(REWARDS)}")
    return REWARDS[name]
