"""Shared prompts in the training forward: each prompt runs through the model once per group.

A GRPO batch holds ``group_size`` samples of every prompt, and the prompt is most of each
sequence (about 44 of 60 tokens in the math recipe). The forward runs each distinct prompt
once, copies its KV cache to the rows of its samples, and runs only the responses on top of
it. Gradients flow back through the copied cache, so logprobs and gradients are those of the
full sequences (up to float rounding), for about half the tokens.

A datum's prompt is found from its weights: the leading zero-weight positions and the next
token, whose hidden state predicts the first weighted target. Datums whose prompts are equal
token for token share them; a datum with no partner runs whole, as if nothing were shared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def shared_prompt_lengths(tokens: Sequence[Sequence[int]], weights: Sequence[torch.Tensor] | None) -> list[int]:
    """Per datum, the length of the prompt it shares with at least one other datum (0 = none)."""
    if weights is None:
        return [0] * len(tokens)
    lengths = []
    for seq, w in zip(tokens, weights):
        weighted = w.nonzero()
        lengths.append(min(len(seq), int(weighted[0]) + 1 if len(weighted) else len(seq)))
    counts: dict[tuple[int, ...], int] = {}
    for seq, m in zip(tokens, lengths):
        counts[tuple(seq[:m])] = counts.get(tuple(seq[:m]), 0) + 1
    return [m if counts[tuple(seq[:m])] > 1 else 0 for seq, m in zip(tokens, lengths)]


def prompt_groups(tokens: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> list[list[int]]:
    """Datum indices grouped by shared prompt, in order of first appearance (unshared datums alone)."""
    groups: dict[object, list[int]] = {}
    for i, (seq, m) in enumerate(zip(tokens, prompt_lengths)):
        groups.setdefault(tuple(seq[:m]) if m else ("alone", i), []).append(i)
    return list(groups.values())


@dataclass
class Layout:
    """The two passes of a batch, as padded tensors.

    Prompts: one row per shared prompt, right-padded to ``P`` columns (``P`` = 0 when nothing
    is shared). Responses: one row per datum, holding the tokens after its prompt (all of them
    when unshared), right-padded to ``R`` columns; ``prompt_row`` says whose cache each extends, and
    ``context_mask`` which of that cache's columns it attends to (none for an unshared datum).
    ``rows`` maps every real position, in datum order, to its row in the concatenation of the
    flattened prompt and response hidden states.
    """

    prompt_ids: torch.Tensor        # [G, P]
    prompt_mask: torch.Tensor       # [G, P]
    prompt_row: torch.Tensor        # [B]
    context_mask: torch.Tensor      # [B, P]
    response_ids: torch.Tensor      # [B, R]
    response_mask: torch.Tensor     # [B, R]
    response_positions: torch.Tensor  # [B, R]
    rows: torch.Tensor              # [N]

    @property
    def padded_tokens(self) -> int:
        return self.prompt_ids.numel() + self.response_ids.numel()


def layout(tokens: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> Layout:
    """Place every datum's tokens in the prompt pass (shared part) and the response pass (the rest)."""
    prompts: dict[tuple[int, ...], int] = {}
    for seq, m in zip(tokens, prompt_lengths):
        if m:
            prompts.setdefault(tuple(seq[:m]), len(prompts))
    width_p = max((len(p) for p in prompts), default=0)
    width_r = max(len(seq) - m for seq, m in zip(tokens, prompt_lengths))
    prompt_ids = torch.zeros(len(prompts), width_p, dtype=torch.long)
    prompt_mask = torch.zeros(len(prompts), width_p, dtype=torch.long)
    for prompt, g in prompts.items():
        prompt_ids[g, :len(prompt)] = torch.tensor(prompt)
        prompt_mask[g, :len(prompt)] = 1
    batch = len(tokens)
    prompt_row = torch.zeros(batch, dtype=torch.long)
    context_mask = torch.zeros(batch, width_p, dtype=torch.long)
    response_ids = torch.zeros(batch, width_r, dtype=torch.long)
    response_mask = torch.zeros(batch, width_r, dtype=torch.long)
    response_positions = torch.zeros(batch, width_r, dtype=torch.long)
    rows = []
    prompt_cells = len(prompts) * width_p
    for i, (seq, m) in enumerate(zip(tokens, prompt_lengths)):
        rest = len(seq) - m
        response_ids[i, :rest] = torch.tensor(seq[m:], dtype=torch.long)
        response_mask[i, :rest] = 1
        response_positions[i] = m + torch.arange(width_r)
        if m:
            g = prompts[tuple(seq[:m])]
            prompt_row[i] = g
            context_mask[i] = prompt_mask[g]
            rows.append(g * width_p + torch.arange(m))
        rows.append(prompt_cells + i * width_r + torch.arange(rest))
    return Layout(prompt_ids, prompt_mask, prompt_row, context_mask, response_ids, response_mask, response_positions,
                  torch.cat(rows))


def hidden_states(body: torch.nn.Module, layout: Layout, device: torch.device) -> torch.Tensor:
    """Last hidden states of the prompt pass then the response pass, flattened: index them with ``layout.rows``."""
    from transformers import DynamicCache

    from mint.lora import cache_kwarg

    if layout.prompt_ids.shape[1] == 0:
        hidden = body(input_ids=layout.response_ids.to(device), attention_mask=layout.response_mask.to(device),
                      position_ids=layout.response_positions.to(device)).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])
    cache = DynamicCache()
    prompt_hidden = body(input_ids=layout.prompt_ids.to(device), attention_mask=layout.prompt_mask.to(device),
                         use_cache=True, **{cache_kwarg(body): cache}).last_hidden_state
    parts = [prompt_hidden.reshape(-1, prompt_hidden.shape[-1])]
    if layout.response_ids.shape[1]:
        cache.reorder_cache(layout.prompt_row.to(device))  # differentiable: index_select on every layer
        mask = torch.cat([layout.context_mask, layout.response_mask], dim=1)
        response_hidden = body(input_ids=layout.response_ids.to(device), attention_mask=mask.to(device),
                               position_ids=layout.response_positions.to(device), use_cache=True,
                               **{cache_kwarg(body): cache}).last_hidden_state
        parts.append(response_hidden.reshape(-1, response_hidden.shape[-1]))
    return torch.cat(parts)
