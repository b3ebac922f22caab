"""TrainingClient: a LoRA adapter on a shared base model, trained with MinT's loss API.

Requests run on one worker thread per client, in submission order, so a script may
queue ``forward_backward`` and ``optim_step`` and wait only for what it needs.
Requests are validated in the caller's thread before they are queued: a malformed
batch raises at the call, naming the field, and never touches weights, gradients
or optimizer state.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mint import lora, prefix
from mint.checkpoints import CheckpointError, read_manifest, write_checkpoint
from mint.futures import APIFuture
from mint.losses import resolve_loss
from mint.models import BaseModel
from mint.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsResponse,
    TensorData,
)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Adam state as safetensors + JSON, not a pickle: loading runs no code, and equal states give equal bytes
# (torch.save's pickle depends on storage sharing), so content-addressed checkpoints compare exactly.
OPTIMIZER_STATE = "optimizer.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
KNOWN_INPUTS = ("target_tokens", "weights", "logprobs", "advantages")
# Padded tokens per forward+backward pass (shared prompts counted once). Activations cost ~1.5 MB
# per token on the 135M embedded model, so this bounds the training transient near 1.4 GB
# while a whole reference GRPO batch (8 prompts x 4 samples, ~870 tokens) still runs in one
# pass; smaller budgets save memory at some speed (bench/microbatch.py measures both).
MICRO_BATCH_TOKENS = 1024

CustomLossFn = Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


class Batch:
    """A validated list of datums: their inputs flattened in datum order, and their layout for the
    forward pass (shared prompts once, then responses; see ``mint.prefix``)."""

    def __init__(self, data: Sequence[Datum], vocab_size: int, required: Sequence[str], max_length: int | None = None):
        self.vocab_size, self.required, self.max_length = vocab_size, tuple(required), max_length
        if not isinstance(data, (list, tuple)) or len(data) == 0:
            raise ValueError("data: expected a non-empty list of types.Datum")
        lengths, inputs = [], {}
        for i, datum in enumerate(data):
            if not isinstance(datum, Datum):
                raise TypeError(f"data[{i}]: expected types.Datum, got {type(datum).__name__}")
            n = datum.model_input.length
            if n == 0:
                raise ValueError(f"data[{i}].model_input: empty (a datum needs at least one token)")
            if max_length is not None and n > max_length:  # past the window the model runs, on untrained positions
                raise ValueError(f"data[{i}].model_input: {n} tokens exceed the model's context of {max_length} "
                                 "(max_position_embeddings); shorten the datum, nothing is truncated")
            for name in required:
                if name not in datum.loss_fn_inputs:
                    raise ValueError(f"data[{i}].loss_fn_inputs: missing {name!r}, which this loss needs")
            for name, value in datum.loss_fn_inputs.items():
                if name not in KNOWN_INPUTS:
                    raise ValueError(f"data[{i}].loss_fn_inputs: unknown input {name!r}; known: {list(KNOWN_INPUTS)}")
                array = value.to_numpy()
                if array.ndim != 1 or array.shape[0] != n:
                    raise ValueError(f"data[{i}].loss_fn_inputs[{name!r}]: shape {list(array.shape)}, expected "
                                     f"[{n}] (model_input.length)")
                inputs.setdefault(name, []).append(torch.from_numpy(array))
            lengths.append(n)
        present = set(inputs)
        for name in present:
            if len(inputs[name]) != len(data):
                raise ValueError(f"loss_fn_inputs[{name!r}]: given for some datums but not all")
        self.data = list(data)
        self.lengths = lengths
        self.tokens = [d.model_input.to_ints() for d in data]
        self.flat_tokens = torch.tensor([t for seq in self.tokens for t in seq], dtype=torch.long)
        self.flat_inputs = {name: torch.cat(values) for name, values in inputs.items()}
        for name, value in [("model_input", self.flat_tokens)] + [
                (n, v) for n, v in self.flat_inputs.items() if n == "target_tokens"]:
            bad = (value < 0) | (value >= vocab_size)
            if bad.any():
                raise ValueError(f"{name}: token id {int(value[bad][0])} is outside the vocabulary [0, {vocab_size})")
        for name, value in self.flat_inputs.items():
            if name != "target_tokens" and not torch.isfinite(value).all():
                raise ValueError(f"loss_fn_inputs[{name!r}]: contains NaN or infinite values")
        self.prompt_lengths = prefix.shared_prompt_lengths(self.tokens, inputs.get("weights"))
        self.layout = prefix.layout(self.tokens, self.prompt_lengths)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, self.lengths))

    def micro_batches(self, token_budget: int) -> list[tuple[list[int], Batch]]:
        """Sub-batches of about ``token_budget`` padded tokens, as (indices into this batch, sub-batch).

        Datums sharing a prompt stay together (a group larger than the budget makes its own
        sub-batch); groups are taken longest first, so rows of similar length pad together.
        """
        if self.layout.padded_tokens <= token_budget:
            return [(list(range(len(self.data))), self)]
        groups = sorted(prefix.prompt_groups(self.tokens, self.prompt_lengths),
                        key=lambda g: max(self.lengths[i] for i in g), reverse=True)
        parts: list[list[int]] = [[]]
        prompts = prompt_width = response_width = 0  # of the last part: its padded size is
        for group in groups:                         # prompts * prompt_width + datums * response_width
            m = self.prompt_lengths[group[0]]
            rest = max(self.lengths[i] - m for i in group)
            widths = (prompts + (m > 0), max(prompt_width, m), max(response_width, rest))
            if parts[-1] and widths[0] * widths[1] + (len(parts[-1]) + len(group)) * widths[2] > token_budget:
                parts.append([])
                widths = (int(m > 0), m, rest)
            parts[-1].extend(group)
            prompts, prompt_width, response_width = widths
        return [(part, Batch([self.data[i] for i in part], self.vocab_size, self.required, self.max_length))
                for part in parts]


class TrainingClient:
    """A LoRA training session (``service.create_lora_training_client``)."""

    def __init__(self, base: BaseModel, rank: int, seed: int | None, train_mlp: bool, train_attn: bool,
                 train_unembed: bool, checkpoint_dir: Path, lora_alpha: int = lora.DEFAULT_LORA_ALPHA,
                 service: Any = None, micro_batch_tokens: int = MICRO_BATCH_TOKENS):
        self.base = base
        self.micro_batch_tokens = micro_batch_tokens
        self.rank = rank
        self.seed = seed
        self._service = service
        self._checkpoint_dir = Path(checkpoint_dir)
        self._lora_config = lora.lora_config(base, rank, lora_alpha, train_mlp, train_attn, train_unembed)
        self.adapter = lora.add_adapter(base, self._lora_config, "train", seed)
        self._params = lora.adapter_parameters(base, self.adapter)
        # Mixed precision: with a bf16 base, the adapter computes in bf16 (peft's float32 adapters cast at every
        # layer), while Adam updates float32 master copies, which checkpoints hold.
        self._state_keys = lora.adapter_state_keys(base, self.adapter)
        if base.dtype == torch.float32:
            self._master = self._params
        else:
            self._master = [p.detach().float().clone() for p in self._params]
            with torch.no_grad():
                for p in self._params:
                    p.data = p.data.to(base.dtype)
        self._optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mint-train")
        weakref.finalize(self, _release, self._executor, base, self.adapter)

    # ---------------------------------------------------------------- requests
    def _submit(self, fn: Callable, *args) -> APIFuture:
        return APIFuture(self._executor.submit(fn, *args))

    def forward_backward(self, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """Forward, loss, backward; gradients accumulate until ``optim_step``."""
        spec, config = resolve_loss(loss_fn, loss_fn_config)
        batch = Batch(data, self.base.vocab_size, spec.required_inputs, self.base.max_length)
        return self._submit(self._run_loss, batch, spec.fn, config, True)

    def forward(self, data: Sequence[Datum], loss_fn: str,
                loss_fn_config: Mapping[str, float] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """The same outputs and metrics as ``forward_backward``, without gradients."""
        spec, config = resolve_loss(loss_fn, loss_fn_config)
        batch = Batch(data, self.base.vocab_size, spec.required_inputs, self.base.max_length)
        return self._submit(self._run_loss, batch, spec.fn, config, False)

    def forward_backward_custom(self, data: Sequence[Datum], loss_fn: CustomLossFn) -> APIFuture[ForwardBackwardOutput]:
        """Any differentiable ``loss_fn(data, logprobs_list) -> (loss, metrics)`` on per-token target logprobs."""
        if not callable(loss_fn):
            raise TypeError("loss_fn: expected a callable (data, logprobs_list) -> (loss, metrics)")
        batch = Batch(data, self.base.vocab_size, ("target_tokens",), self.base.max_length)
        return self._submit(self._run_custom, batch, loss_fn)

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        """One AdamW step on the accumulated gradients (clipped if ``grad_clip_norm`` > 0), then zero them."""
        if not isinstance(adam_params, AdamParams):
            raise TypeError(f"adam_params: expected types.AdamParams, got {type(adam_params).__name__}")
        return self._submit(self._run_optim_step, adam_params)

    def save_state(self, name: str) -> APIFuture[SaveWeightsResponse]:
        """Save LoRA weights and optimizer state; ``.result().path`` loads in any process."""
        path = self._checkpoint_path(name)
        return self._submit(self._run_save, path, True)

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]:
        """Save LoRA weights only, for ``create_sampling_client(model_path=...)``."""
        path = self._checkpoint_path(name)
        return self._submit(self._run_save, path, False)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None):
        """Save the current weights and return a SamplingClient on them (a snapshot: later training does not
        change it)."""
        path = self.save_weights_for_sampler(name or f"sampler-step-{self.step:06d}").result().path
        return self._service.create_sampling_client(base_model=self.base.name, model_path=path)

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load LoRA weights from a checkpoint; the optimizer starts fresh."""
        manifest = self._check_checkpoint(path)
        return self._submit(self._run_load, Path(path), manifest, False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Load LoRA weights and optimizer state: training continues exactly where it was saved."""
        manifest = self._check_checkpoint(path)
        if OPTIMIZER_STATE not in manifest["files"]:
            raise CheckpointError(f"checkpoint {path!r} holds sampler weights only (no optimizer state); "
                                  "use load_state, or a path from save_state")
        return self._submit(self._run_load, Path(path), manifest, True)

    def get_tokenizer(self):
        return self.base.tokenizer

    def get_info(self) -> GetInfoResponse:
        config = self.base.model.config
        return GetInfoResponse(model_name=self.base.name, lora_rank=self.rank, model_data={
            "arch": config.model_type, "dtype": str(self.base.dtype).removeprefix("torch."),
            "device": str(self.base.device), "vocab_size": self.base.vocab_size,
            "weights": self.base.weights, "target_modules": sorted(self._lora_config.target_modules),
            "lora_alpha": self._lora_config.lora_alpha, "step": self.step})

    # -------------------------------------------------------- async twins
    async def forward_backward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward_backward(data, loss_fn, loss_fn_config)

    async def forward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_custom_async(self, data, loss_fn):
        return self.forward_backward_custom(data, loss_fn)

    async def optim_step_async(self, adam_params):
        return self.optim_step(adam_params)

    async def save_state_async(self, name):
        return self.save_state(name)

    async def save_weights_for_sampler_async(self, name):
        return self.save_weights_for_sampler(name)

    async def load_state_async(self, path):
        return self.load_state(path)

    async def load_state_with_optimizer_async(self, path):
        return self.load_state_with_optimizer(path)

    async def save_weights_and_get_sampling_client_async(self, name=None, retry_config=None):
        import asyncio

        return await asyncio.to_thread(self.save_weights_and_get_sampling_client, name)

    # ------------------------------------------------------------- work
    def _target_logprobs(self, batch: Batch, grad_mask: torch.Tensor | None) -> torch.Tensor:
        """Learner logprobs of ``target_tokens`` at every real position, flat in datum order.

        Only positions in ``grad_mask`` (weight != 0) keep a graph through the unembedding:
        the prompt's logprobs are reported but cost no backward through the 49k-way head.
        """
        targets = batch.flat_inputs["target_tokens"].to(self.base.device)
        with lora.active(self.base, self.adapter) as model:
            for p in self._params:
                p.requires_grad_(True)
            body, head = lora.decoder_and_head(model)
            hidden = prefix.hidden_states(body, batch.layout, self.base.device)
            rows = batch.layout.rows.to(self.base.device)
            if grad_mask is None and torch.is_grad_enabled():
                return lora.token_logprobs(head, hidden[rows], targets)
            if grad_mask is None or not torch.is_grad_enabled():
                grad_mask = torch.zeros_like(targets, dtype=torch.bool)
            grad_idx = grad_mask.nonzero().squeeze(-1).to(self.base.device)
            rest_idx = (~grad_mask).nonzero().squeeze(-1).to(self.base.device)
            with torch.no_grad():  # a shared prompt's positions repeat in every datum of its group: compute once
                pairs = rows[rest_idx] * self.base.vocab_size + targets[rest_idx]
                unique, inverse = torch.unique(pairs, return_inverse=True)
                rest = lora.token_logprobs(head, hidden[unique // self.base.vocab_size].detach(),
                                           unique % self.base.vocab_size)[inverse]
            live = lora.token_logprobs(head, hidden[rows[grad_idx]], targets[grad_idx])
            flat = torch.zeros(targets.shape[0], dtype=torch.float32, device=self.base.device)
            return flat.index_copy(0, rest_idx, rest).index_copy(0, grad_idx, live)

    def _run_loss(self, batch: Batch, fn, config: dict, backward: bool) -> ForwardBackwardOutput:
        """The loss summed over micro-batches, each backpropagated on its own: the losses are sums over
        tokens, so the accumulated gradient is the whole batch's."""
        logprobs: list[torch.Tensor] = [torch.empty(0)] * len(batch.data)
        total = 0.0
        for indices, part in batch.micro_batches(self.micro_batch_tokens):
            inputs = {k: v.to(self.base.device) for k, v in part.flat_inputs.items() if k != "target_tokens"}
            weights = part.flat_inputs.get("weights")
            with torch.set_grad_enabled(backward):
                lp = self._target_logprobs(part, None if weights is None else weights != 0)
                loss = fn(lp, inputs, config)
                if backward and loss.requires_grad:  # all weights 0: the loss is a constant, nothing to accumulate
                    loss.backward()
            total += float(loss.detach())
            for i, x in zip(indices, part.split(lp.detach().cpu())):
                logprobs[i] = x
        return ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": TensorData.from_torch(x)} for x in logprobs],
                                     metrics={"loss:sum": total})

    def _run_custom(self, batch: Batch, fn: CustomLossFn) -> ForwardBackwardOutput:
        """A custom loss sees the whole batch's logprobs at once. Over the micro-batch budget, the logprobs
        come from a forward without graph, the loss's gradient with respect to them is taken, and each
        micro-batch is then recomputed and backpropagated with that gradient: exact, at one extra forward."""
        parts = batch.micro_batches(self.micro_batch_tokens)
        if len(parts) == 1:
            with torch.enable_grad():
                lp = self._target_logprobs(batch, None)
                lp_list = batch.split(lp)
                loss, metrics = self._custom_loss(fn, batch, lp_list)
                loss.backward()
        else:
            lp_list = [torch.empty(0)] * len(batch.data)
            with torch.no_grad():
                for indices, part in parts:
                    for i, x in zip(indices, part.split(self._target_logprobs(part, None))):
                        lp_list[i] = x
            lp_list = [x.detach().requires_grad_(True) for x in lp_list]
            with torch.enable_grad():
                loss, metrics = self._custom_loss(fn, batch, lp_list)
                loss.backward()
                for indices, part in parts:
                    upstream = torch.cat([torch.zeros_like(lp_list[i]) if lp_list[i].grad is None else lp_list[i].grad
                                          for i in indices])
                    (self._target_logprobs(part, None) * upstream).sum().backward()
        return ForwardBackwardOutput(
            loss_fn_outputs=[{"logprobs": TensorData.from_torch(x.detach().cpu())} for x in lp_list],
            metrics={"loss:sum": float(loss.detach()), **{k: float(v) for k, v in (metrics or {}).items()}})

    @staticmethod
    def _custom_loss(fn: CustomLossFn, batch: Batch, lp_list: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss, metrics = fn(batch.data, lp_list)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise TypeError("forward_backward_custom: loss_fn must return (scalar tensor, metrics dict)")
        return loss, metrics

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._master, lr=0.0, foreach=True)

    def _run_optim_step(self, adam: AdamParams) -> OptimStepResponse:
        if self._optimizer is None:
            self._optimizer = self._make_optimizer()
        if self._master is not self._params:
            for master, p in zip(self._master, self._params):
                master.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        grads = [p.grad for p in self._master if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        if not math.isfinite(grad_norm):
            self._optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"optim_step: gradient norm is {grad_norm}; the step was skipped and "
                                     "gradients cleared (weights unchanged)")
        if adam.grad_clip_norm > 0 and grad_norm > adam.grad_clip_norm:
            torch._foreach_mul_(grads, adam.grad_clip_norm / (grad_norm + 1e-6))
        for group in self._optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._copy_master_to_model()
        self.step += 1
        return OptimStepResponse(metrics={"grad_norm": grad_norm, "learning_rate": adam.learning_rate,
                                          "step": float(self.step)})

    def _copy_master_to_model(self) -> None:
        if self._master is not self._params:
            with torch.no_grad():
                torch._foreach_copy_(self._params, self._master)

    def _checkpoint_path(self, name: str) -> Path:
        if not isinstance(name, str) or not name.strip():
            raise ValueError("name: expected a non-empty checkpoint name or an absolute folder path")
        path = Path(name).expanduser()
        if path.is_absolute():
            return path
        if ".." in path.parts:
            raise ValueError(f"name: {name!r} must not contain '..'")
        return self._checkpoint_dir / path

    def _run_save(self, path: Path, with_optimizer: bool) -> SaveWeightsResponse:
        state = {key: m.detach().clone().contiguous() for key, m in zip(self._state_keys, self._master)}
        optimizer_state = self._optimizer.state_dict() if (with_optimizer and self._optimizer) else None

        def write(folder: Path) -> None:
            save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            config = self._lora_config.to_dict()
            config["base_model_name_or_path"] = self.base.name
            config["target_modules"] = sorted(config["target_modules"])
            (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
            if with_optimizer:
                groups = None
                if optimizer_state is not None:
                    save_file({f"{i}.{name}": value.detach().clone().contiguous()
                               for i, values in optimizer_state["state"].items() for name, value in values.items()},
                              str(folder / OPTIMIZER_TENSORS))
                    groups = optimizer_state["param_groups"]
                (folder / OPTIMIZER_STATE).write_text(json.dumps({"param_groups": groups, "step": self.step},
                                                                 sort_keys=True))

        meta = {"kind": "state" if with_optimizer else "sampler", "base_model": self.base.name,
                "rank": self.rank, "step": self.step}
        return SaveWeightsResponse(path=str(write_checkpoint(path, write, meta)))

    def _check_checkpoint(self, path: str) -> dict:
        manifest = read_manifest(path)
        if manifest.get("rank") != self.rank:
            raise CheckpointError(f"checkpoint {path!r} has LoRA rank {manifest.get('rank')}, this client "
                                  f"has rank {self.rank}")
        config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
        if sorted(config["target_modules"]) != sorted(self._lora_config.target_modules):
            raise CheckpointError(f"checkpoint {path!r} adapts {sorted(config['target_modules'])}, this client "
                                  f"adapts {sorted(self._lora_config.target_modules)}")
        return manifest

    def _run_load(self, path: Path, manifest: dict, with_optimizer: bool) -> LoadWeightsResponse:
        weights = load_file(str(path / ADAPTER_WEIGHTS))
        optimizer = None
        if with_optimizer:
            saved = json.loads((path / OPTIMIZER_STATE).read_text())
            if saved["param_groups"] is not None:
                state: dict[int, dict[str, torch.Tensor]] = {}
                for key, value in load_file(str(path / OPTIMIZER_TENSORS), device=str(self.base.device)).items():
                    index, name = key.split(".", 1)
                    state.setdefault(int(index), {})[name] = value
                optimizer = self._make_optimizer()
                optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
        missing = set(self._state_keys) ^ set(weights)
        if missing:
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit this adapter: {sorted(missing)[:3]}")
        with torch.no_grad():
            for key, master in zip(self._state_keys, self._master):
                master.copy_(weights[key])
        self._copy_master_to_model()
        for p in [*self._params, *self._master]:
            p.grad = None
        self._optimizer = optimizer
        self.step = int(manifest.get("step", 0))
        return LoadWeightsResponse(path=str(path))


def _release(executor: concurrent.futures.ThreadPoolExecutor, base: BaseModel, adapter: str) -> None:
    executor.shutdown(wait=False)
    lora.retire_adapter(base, adapter)
