"""The five training losses of the MinT API, as pure torch functions.

Every loss sees the tokens of a whole batch flattened into one dimension:

    lp       learner logprobs of the target tokens (with grad)
    inputs   the other ``loss_fn_inputs`` (``logprobs``, ``advantages``, ``weights``), same shape
    config   ``loss_fn_config`` merged over the loss's defaults

and returns the loss SUMMED over tokens (no mean, as the hosted API does).
When ``weights`` is given it multiplies every position's loss, so positions of
weight 0 (the prompt) contribute nothing, not even NaN from an overflowing ratio.
KL penalties are not here: the RL loop folds them into the advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor
LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]


def _mask(inputs: Mapping[str, Tensor], like: Tensor) -> Tensor:
    weights = inputs.get("weights")
    return torch.ones_like(like) if weights is None else weights.to(like.dtype)


def _log_ratio(lp: Tensor, inputs: Mapping[str, Tensor], mask: Tensor) -> Tensor:
    # Zero where masked, so exp() never overflows on prompt positions whose sampler logprob is a placeholder.
    return torch.where(mask != 0, lp - inputs["logprobs"], torch.zeros_like(lp))


def cross_entropy(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """Supervised learning: ``-(lp * weights).sum()``."""
    return -(lp * _mask(inputs, lp)).sum()


def importance_sampling(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """Off-policy policy gradient: ``-(exp(lp - q) * A).sum()``; its gradient is ``ratio * A * grad(lp)``."""
    mask = _mask(inputs, lp)
    ratio = torch.exp(_log_ratio(lp, inputs, mask))
    return -(ratio * inputs["advantages"] * mask).sum()


def ppo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """Clipped surrogate: ``-min(ratio*A, clamp(ratio, lo, hi)*A).sum()``."""
    mask = _mask(inputs, lp)
    advantages = inputs["advantages"]
    ratio = torch.exp(_log_ratio(lp, inputs, mask))
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -(torch.minimum(ratio * advantages, clipped * advantages) * mask).sum()


def cispo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """Clipped importance-sampling policy optimization: ``-(clamp(ratio).detach() * lp * A).sum()``.

    The clipped ratio is a constant weight, so every token keeps a gradient (unlike PPO,
    which zeroes the gradient of clipped tokens).
    """
    mask = _mask(inputs, lp)
    ratio = torch.exp(_log_ratio(lp, inputs, mask))
    weight = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(weight * lp * inputs["advantages"] * mask).sum()


def dro(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    """Direct reward optimization: ``-(lp*A - 0.5*beta*(lp - q)**2).sum()``.

    The quadratic term keeps the learner near the sampler without a ratio, so it is
    stable far off-policy. ``beta`` defaults to 0.05.
    """
    mask = _mask(inputs, lp)
    log_ratio = _log_ratio(lp, inputs, mask)
    beta = config["beta"]
    return -((lp * inputs["advantages"] - 0.5 * beta * log_ratio**2) * mask).sum()


@dataclass(frozen=True)
class LossSpec:
    fn: LossFn
    required_inputs: tuple[str, ...]
    defaults: dict[str, float] = field(default_factory=dict)

    @property
    def optional_inputs(self) -> tuple[str, ...]:
        return ("weights",)


_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("target_tokens",)),
    "importance_sampling": LossSpec(importance_sampling, _POLICY_INPUTS),
    "ppo": LossSpec(ppo, _POLICY_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(cispo, _POLICY_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(dro, _POLICY_INPUTS, {"beta": 0.05}),
}


def resolve_loss(loss_fn: str, loss_fn_config: Mapping[str, float] | None) -> tuple[LossSpec, dict[str, float]]:
    """Look up a loss and merge its config over the defaults, refusing unknown names and keys."""
    if loss_fn not in LOSSES:
        raise ValueError(f"loss_fn: unknown loss {loss_fn!r}; expected one of {sorted(LOSSES)}")
    spec = LOSSES[loss_fn]
    config = dict(spec.defaults)
    for key, value in (loss_fn_config or {}).items():
        if key not in spec.defaults:
            allowed = sorted(spec.defaults) or "no keys"
            raise ValueError(f"loss_fn_config: unknown key {key!r} for loss {loss_fn!r}; allowed: {allowed}")
        if not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            raise ValueError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        config[key] = float(value)
    if "clip_low_threshold" in config and config["clip_low_threshold"] > config["clip_high_threshold"]:
        raise ValueError(
            f"loss_fn_config: clip_low_threshold {config['clip_low_threshold']} must be <= "
            f"clip_high_threshold {config['clip_high_threshold']}"
        )
    return spec, config
