"""Pure GRPO math (seed/RL-GRPO.md): group advantages, KL folding, datums from samples.

No model and no I/O here: every function maps numbers to numbers, so the RL loop
around it (a script, or the Prefect flow) stays a few readable lines.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mint import types


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """``reward - mean(group)``: above-average samples are pushed up, below-average down (no std scaling)."""
    if len(rewards) == 0:
        raise ValueError("rewards: a group needs at least one sample")
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def is_constant(rewards: Sequence[float]) -> bool:
    """A group whose rewards are all equal carries no GRPO signal (all advantages are 0)."""
    return max(rewards) - min(rewards) == 0


def full_sequence(prompt_tokens: Sequence[int], sampled: types.SampledSequence) -> types.SampledSequence:
    """Prompt + completion as one sequence whose ``logprobs`` align with ``tokens`` (prompt positions 0.0).

    This is the ``seq`` of the seed's Datum snippet: ``tokens[:-1]`` is the model input,
    ``tokens[1:]`` the targets, ``logprobs[1:]`` the sampler logprob of each target.
    """
    if sampled.logprobs is None:
        raise ValueError("sampled.logprobs: the sampler did not return logprobs")
    return types.SampledSequence(tokens=[*prompt_tokens, *sampled.tokens],
                                 logprobs=[0.0] * len(prompt_tokens) + list(sampled.logprobs),
                                 stop_reason=sampled.stop_reason)


def datum_from_sequence(seq: types.SampledSequence, prompt_len: int, advantage: float) -> types.Datum:
    """The seed's Datum: weight 0 and advantage 0 on the prompt, weight 1 and ``advantage`` on the response."""
    response_len = len(seq.tokens) - prompt_len
    if prompt_len < 1 or response_len < 0:
        raise ValueError(f"prompt_len: {prompt_len} must be in [1, {len(seq.tokens)}]")
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=seq.tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": seq.tokens[1:],
            "weights": [0.0] * (prompt_len - 1) + [1.0] * response_len,
            "logprobs": seq.logprobs[1:],
            "advantages": [0.0] * (prompt_len - 1) + [advantage] * response_len,
        },
    )


def group_datums(prompt_tokens: Sequence[int], samples: Sequence[types.SampledSequence],
                 rewards: Sequence[float]) -> list[types.Datum]:
    """Datums for one group: advantages centered on the group mean."""
    if len(samples) != len(rewards):
        raise ValueError(f"rewards: {len(rewards)} values for {len(samples)} samples")
    return [datum_from_sequence(full_sequence(prompt_tokens, s), len(prompt_tokens), a)
            for s, a in zip(samples, group_advantages(rewards))]


def incorporate_kl_penalty(datums: Sequence[types.Datum], reference_logprobs: Sequence[Sequence[float]],
                           coef: float) -> tuple[list[types.Datum], float]:
    """Fold a KL penalty against a reference model into the advantages (tinker-cookbook style).

    With ``d = lp_sampled - lp_ref`` on response tokens (mask = weights != 0):
    ``advantages += coef * mask * (mean(d) - d)``, where the mean runs over every masked token of
    the batch. Returns the new datums and the mean ``d`` (a sample-based KL estimate).
    """
    diffs, masks = [], []
    for datum, ref in zip(datums, reference_logprobs, strict=True):
        sampled = datum.loss_fn_inputs["logprobs"].to_torch()
        mask = datum.loss_fn_inputs["weights"].to_torch() != 0
        ref = torch.as_tensor(ref, dtype=torch.float32)
        diffs.append(torch.where(mask, sampled - ref, torch.zeros_like(sampled)))
        masks.append(mask)
    total = sum(int(m.sum()) for m in masks)
    mean_kl = float(sum(d.sum() for d in diffs) / max(total, 1))
    out = []
    for datum, d, mask in zip(datums, diffs, masks):
        advantages = datum.loss_fn_inputs["advantages"].to_torch() + coef * mask * (mean_kl - d)
        inputs = {**datum.loss_fn_inputs, "advantages": advantages}
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return out, mean_kl


def overlong_penalty(length: int, max_length: int, cache: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment R_length: 0 up to ``L_max - L_cache`` tokens, then falling
    linearly to ``-factor`` at ``L_max`` (``max_length``), ``-factor`` beyond. ``cache`` = 0 turns it off."""
    if cache <= 0:
        return 0.0
    if not 0 < cache <= max_length:
        raise ValueError(f"overlong cache: L_cache {cache} must be in (0, L_max={max_length}]")
    expected = max_length - cache
    if length <= expected:
        return 0.0
    if length <= max_length:
        return factor * (expected - length) / cache
    return -factor


LOSS_NORMALIZATIONS = ("sum", "token", "sequence")


def normalize_advantages(datums: Sequence[types.Datum], mode: str) -> list[types.Datum]:
    """Scale advantages so the summed loss becomes a mean.

    ``sum``: as they are (the engine sums over tokens). ``token``: divided by the batch's total
    response tokens, DAPO's token-level normalization (long replies weigh in proportion to their
    length). ``sequence``: each datum's divided by its own response length times the number of
    datums, GRPO's per-sample mean (every reply weighs the same).
    """
    if mode not in LOSS_NORMALIZATIONS:
        raise ValueError(f"loss_normalization: {mode!r}; expected one of {LOSS_NORMALIZATIONS}")
    if mode == "sum" or not datums:
        return list(datums)
    lengths = [float((d.loss_fn_inputs["weights"].to_torch() != 0).sum()) for d in datums]
    total = sum(lengths)
    out = []
    for datum, length in zip(datums, lengths):
        scale = 1.0 / max(total, 1.0) if mode == "token" else 1.0 / (max(length, 1.0) * len(datums))
        inputs = {**datum.loss_fn_inputs, "advantages": datum.loss_fn_inputs["advantages"].to_torch() * scale}
        out.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return out
