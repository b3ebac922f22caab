"""SamplingClient: batched generation with a KV cache, and prompt logprobs.

``sample()`` queues a request and returns a future; the first time any queued
result is asked for, every queued request runs as ONE batch: all prompts are
prefilled together once, each prompt's cache is then copied to its
``num_samples`` rows, and rows that stop leave the batch. So the usual loop,

    futures = [sc.sample(p, group_size, params) for p in prompts]
    results = [f.result() for f in futures]

decodes all groups at once. The logprob reported for a sampled token is the
model's own (temperature 1) log-probability, computed by the same head code as the
trainer's forward, so importance ratios start at 1 on-policy.

Prompts are never truncated, nor ``max_tokens`` cut: an empty prompt, one longer than the
model's context (``max_position_embeddings``), or ``max_tokens`` beyond what the context has
left after the prompt raises ValueError at the call, naming the lengths. ``max_tokens=None``
means "up to the end of the context".
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from mint import lora
from mint.futures import APIFuture
from mint.models import BaseModel
from mint.types import ModelInput, SampledSequence, SampleResponse, SamplingParams


@dataclass
class _Request:
    tokens: list[int]
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool
    topk: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    stop_ids: set[int] = field(default_factory=set)
    stop_strings: list[str] = field(default_factory=list)
    max_tokens: int = 0
    generator: torch.Generator | None = None


class SamplingClient:
    """Samples from a base model, optionally with a LoRA adapter (merged into the plain sampling model)."""

    def __init__(self, base: BaseModel, adapter: lora.MergedAdapter | None = None, model_path: str | None = None):
        self.base = base
        self.adapter = adapter
        self.model_path = model_path
        self._pending: list[_Request] = []
        self._queue_lock = threading.Lock()
        self._run_lock = threading.Lock()

    def get_tokenizer(self):
        return self.base.tokenizer

    # ---------------------------------------------------------------- requests
    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0) -> APIFuture[SampleResponse]:
        """Queue ``num_samples`` completions of ``prompt``; see the module docstring for batching."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected types.SamplingParams, got {type(params).__name__}")
        tokens = self._check_prompt(prompt)
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
            raise ValueError(f"num_samples: expected an integer >= 1, got {num_samples!r}")
        if not isinstance(topk_prompt_logprobs, int) or topk_prompt_logprobs < 0:
            raise ValueError(f"topk_prompt_logprobs: expected an integer >= 0, got {topk_prompt_logprobs!r}")
        room = self.base.max_length - len(tokens)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(f"sampling_params.max_tokens: {max_tokens} new tokens after a {len(tokens)}-token "
                             f"prompt exceed the model's context of {self.base.max_length}; use at most {room}")
        vocab = self.base.vocab_size
        for t in params.stop_ids():
            if not 0 <= t < vocab:
                raise ValueError(f"sampling_params.stop: token id {t} is outside the vocabulary [0, {vocab})")
        request = _Request(tokens, num_samples, params, include_prompt_logprobs or topk_prompt_logprobs > 0,
                           topk_prompt_logprobs, stop_ids=set(params.stop_ids()) | set(self.base.stop_token_ids()),
                           stop_strings=params.stop_strings(), max_tokens=max_tokens,
                           generator=_generator(params.seed))
        with self._queue_lock:
            self._pending.append(request)
        return APIFuture(request.future, before_wait=self._run_pending)

    async def sample_async(self, prompt, num_samples=1, sampling_params=None, include_prompt_logprobs=False,
                           topk_prompt_logprobs=0):
        return self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """Per-token logprobs of ``prompt`` under this model; the first entry is None."""
        tokens = self._check_prompt(prompt)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            with lora.merged(self.base, self.adapter) as model, torch.inference_mode():
                body, head = lora.decoder_and_head(model)
                ids = torch.tensor([tokens], device=self.base.device)
                hidden = body(input_ids=ids).last_hidden_state[0, :-1]
                lp = lora.token_logprobs(head, hidden, ids[0, 1:])
            future.set_result([None] + lp.tolist())
        except Exception as e:
            future.set_exception(e)
        return APIFuture(future)

    async def compute_logprobs_async(self, prompt):
        return self.compute_logprobs(prompt)

    def next_token_logprobs(self, prompt: ModelInput, token_ids: list[int]) -> APIFuture[list[float]]:
        """log p(t | prompt) for each ``t`` in ``token_ids``: one forward, the next position only
        (a judge's grading tokens; a mintflow extension of the API)."""
        tokens = self._check_prompt(prompt)
        if not token_ids or any(not 0 <= t < self.base.vocab_size for t in token_ids):
            raise ValueError(f"token_ids: expected ids in [0, {self.base.vocab_size}), got {token_ids!r}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            with lora.merged(self.base, self.adapter) as model, torch.inference_mode():
                body, head = lora.decoder_and_head(model)
                hidden = body(input_ids=torch.tensor([tokens], device=self.base.device)).last_hidden_state[0, -1:]
                logprobs = torch.log_softmax(head(hidden).float(), dim=-1)[0]
            future.set_result(logprobs[torch.tensor(token_ids, device=logprobs.device)].tolist())
        except Exception as e:
            future.set_exception(e)
        return APIFuture(future)

    def _check_prompt(self, prompt: ModelInput) -> list[int]:
        if not isinstance(prompt, ModelInput):
            raise TypeError(f"prompt: expected types.ModelInput, got {type(prompt).__name__}")
        tokens = prompt.to_ints()
        if not tokens:
            raise ValueError("prompt: empty (needs at least one token)")
        if len(tokens) > self.base.max_length:  # positions past the window run, but on weights never trained there
            raise ValueError(f"prompt: {len(tokens)} tokens exceed the model's context of {self.base.max_length} "
                             "(max_position_embeddings); shorten the prompt, nothing is truncated")
        vocab = self.base.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return tokens

    # ------------------------------------------------------------- work
    def _run_pending(self) -> None:
        with self._run_lock:
            with self._queue_lock:
                requests, self._pending = self._pending, []
            if not requests:
                return
            try:
                with lora.merged(self.base, self.adapter) as model, torch.inference_mode():
                    responses = _generate(model, self.base, requests)
            except BaseException as e:
                for r in requests:
                    r.future.set_exception(e)
                if not isinstance(e, Exception):
                    raise
                return
            for r, response in zip(requests, responses):
                r.future.set_result(response)


def _generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return generator


def _pick_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of float32 ``logits`` with temperature, top-k and top-p (Gumbel-max)."""
    if params.temperature == 0:
        return logits.argmax(-1)
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix whose mass reaches top_p
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    uniform = torch.rand(scaled.shape, generator=generator).clamp_(min=1e-20).to(scaled.device)
    return (scaled - torch.log(-torch.log(uniform))).argmax(-1)


def _generate(model: torch.nn.Module, base: BaseModel, requests: Sequence[_Request]) -> list[SampleResponse]:
    device = base.device
    body, head = lora.decoder_and_head(model)
    tokenizer = base.tokenizer
    pad = tokenizer.pad_token_id or 0

    # Prefill every prompt once, left-padded so that all rows end at the same column.
    lengths = [len(r.tokens) for r in requests]
    width = max(lengths)
    ids = torch.full((len(requests), width), pad, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for i, r in enumerate(requests):
        ids[i, width - lengths[i]:] = torch.tensor(r.tokens)
        mask[i, width - lengths[i]:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    cache_arg = lora.cache_kwarg(body)
    hidden = body(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                  use_cache=True, **{cache_arg: cache}).last_hidden_state

    responses: list[dict] = [{} for _ in requests]
    for i, r in enumerate(requests):
        if r.prompt_logprobs:
            responses[i] = _prompt_logprobs(head, hidden[i, width - lengths[i]:], r)
    last_logits = head(hidden[:, -1]).float()

    # One row per sample: copy each prompt's cache to its num_samples rows.
    row_request = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor([r.num_samples for r in requests]))
    cache.reorder_cache(row_request.to(device))
    mask = mask[row_request]
    next_position = positions[row_request, -1] + 1
    logits = last_logits[row_request.to(device)]
    rows = [(int(q), k) for q, k in zip(row_request.tolist(), _sample_index(requests))]
    out_tokens: list[list[list[int]]] = [[[] for _ in range(r.num_samples)] for r in requests]
    out_logprobs: list[list[list[float]]] = [[[] for _ in range(r.num_samples)] for r in requests]
    reasons: list[list[str]] = [["length"] * r.num_samples for r in requests]
    active = [i for i, (q, _) in enumerate(rows) if requests[q].max_tokens > 0]
    if len(active) < len(rows):
        logits, mask, next_position = logits[active], mask[active], next_position[active]
        cache.batch_select_indices(torch.tensor(active, dtype=torch.long, device=device))
    active_rows = [rows[i] for i in active]

    while active_rows:
        logprobs_all = torch.log_softmax(logits, dim=-1)
        chosen = torch.empty(len(active_rows), dtype=torch.long, device=device)
        row_of = torch.tensor([q for q, _ in active_rows])
        for q in row_of.unique().tolist():
            idx = (row_of == q).nonzero().squeeze(-1).to(device)
            chosen[idx] = _pick_tokens(logits[idx], requests[q].params, requests[q].generator)
        chosen_lp = logprobs_all.gather(-1, chosen[:, None]).squeeze(-1).tolist()
        chosen_list = chosen.tolist()
        keep = []
        for j, (q, k) in enumerate(active_rows):
            r = requests[q]
            toks = out_tokens[q][k]
            toks.append(chosen_list[j])
            out_logprobs[q][k].append(chosen_lp[j])
            if chosen_list[j] in r.stop_ids or _hits_stop_string(tokenizer, toks, r.stop_strings):
                reasons[q][k] = "stop"
            elif len(toks) < r.max_tokens:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(active_rows):
            keep_t = torch.tensor(keep)
            cache.batch_select_indices(keep_t.to(device))
            mask, next_position, chosen = mask[keep_t], next_position[keep_t], chosen[keep_t.to(device)]
            active_rows = [active_rows[j] for j in keep]
        mask = torch.cat([mask, torch.ones(len(active_rows), 1, dtype=torch.long)], dim=1)
        hidden = body(input_ids=chosen[:, None], attention_mask=mask.to(device),
                      position_ids=next_position[:, None].to(device), use_cache=True,
                      **{cache_arg: cache}).last_hidden_state
        next_position = next_position + 1
        logits = head(hidden[:, -1]).float()

    return [
        SampleResponse(
            sequences=[SampledSequence(tokens=out_tokens[q][k], logprobs=out_logprobs[q][k], stop_reason=reasons[q][k])
                       for k in range(r.num_samples)],
            **responses[q])
        for q, r in enumerate(requests)
    ]


def _sample_index(requests: Sequence[_Request]) -> list[int]:
    return [k for r in requests for k in range(r.num_samples)]


def _hits_stop_string(tokenizer, tokens: list[int], stops: list[str]) -> bool:
    if not stops:
        return False
    tail = tokenizer.decode(tokens[-(max(len(s) for s in stops) + 2):])
    return any(s in tail for s in stops)


def _prompt_logprobs(head: torch.nn.Module, hidden: torch.Tensor, request: _Request) -> dict:
    """Logprob of each prompt token given the ones before it (first is None), and optionally the top-k."""
    targets = torch.tensor(request.tokens[1:], device=hidden.device)
    result: dict = {}
    if len(targets):
        lp = lora.token_logprobs(head, hidden[:-1], targets)
    else:
        lp = torch.zeros(0)
    result["prompt_logprobs"] = [None] + lp.tolist()
    if request.topk > 0:
        logprobs = torch.log_softmax(head(hidden[:-1]).float(), dim=-1)
        values, indices = torch.topk(logprobs, request.topk, dim=-1)
        result["topk_prompt_logprobs"] = [None] + [
            list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return result
