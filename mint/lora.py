"""LoRA on a shared base model, for training (peft) and for sampling (merged), and the logprob head.

All clients of a process share one base model. Each training client holds its own named
peft adapter on it; the adapter to run is picked under the base model's lock. Sampling
clients hold only their LoRA tensors, merged on demand into one plain sampling model that
shares the base weights (``merged``), so a sampling client costs a few MB.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from collections.abc import Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict

from mint.models import BaseModel

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
DEFAULT_LORA_ALPHA = 32

_names = itertools.count()
# LoRA on a tied lm_head adds a separate low-rank term; the frozen shared weight is never merged or saved.
warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*")
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")


def lora_config(base: BaseModel, rank: int, alpha: int, train_mlp: bool, train_attn: bool,
                train_unembed: bool) -> LoraConfig:
    """The peft config for a MinT-style LoRA: which linear layers get an adapter."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank: LoRA rank must be an integer >= 1, got {rank!r}")
    wanted = (ATTN_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ()) + (
        UNEMBED_MODULES if train_unembed else ())
    if not wanted:
        raise ValueError("train_mlp, train_attn, train_unembed: at least one must be True")
    present = {name.rsplit(".", 1)[-1] for name, m in base.model.named_modules()
               if isinstance(m, (torch.nn.Linear, BaseTunerLayer))}  # adapted layers are peft wrappers
    targets = [m for m in wanted if m in present]
    if not targets:
        raise ValueError(f"base_model {base.name!r} has none of the LoRA target layers {list(wanted)}")
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none",
                      task_type="CAUSAL_LM")


def add_adapter(base: BaseModel, config: LoraConfig, prefix: str, seed: int | None = None) -> str:
    """Add a new adapter to the base model and return its name. ``seed`` fixes the LoRA init."""
    name = f"{prefix}{next(_names)}"
    with base.lock, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        if base.peft_model is None:
            base.peft_model = get_peft_model(base.model, config, adapter_name=name)
        else:
            base.peft_model.add_adapter(name, config)
        base.active_adapter = None
        while base.retired_adapters:  # after the add: peft cannot delete a model's last adapter
            delete_adapter(base, base.retired_adapters.pop())
    return name


def retire_adapter(base: BaseModel, name: str) -> None:
    """Mark a released client's adapter for deletion at the next ``add_adapter``.

    Called from a garbage-collection finalizer, which can run in the middle of any code of this
    thread, peft's included, while it holds ``base.lock`` (an RLock, so it would not wait):
    deleting there changed the adapters under a running state-dict walk. Appending is safe.
    """
    base.retired_adapters.append(name)


def delete_adapter(base: BaseModel, name: str) -> None:
    with base.lock:
        peft_model: PeftModel = base.peft_model
        if peft_model is not None and name in peft_model.peft_config:
            if len(peft_model.peft_config) > 1:
                if base.active_adapter == name:
                    other = next(n for n in peft_model.peft_config if n != name)
                    peft_model.base_model.set_adapter(other, inference_mode=True)
                    base.active_adapter = other
                peft_model.delete_adapter(name)
            # The last adapter stays (peft cannot delete it); it is inert unless activated.


@contextlib.contextmanager
def active(base: BaseModel, adapter: str) -> Iterator[torch.nn.Module]:
    """Run the base model with the training ``adapter`` active; yields the HF model."""
    with base.lock:
        if base.active_adapter != adapter:
            base.peft_model.base_model.set_adapter(adapter, inference_mode=True)
            base.active_adapter = adapter
        yield base.model


def adapter_parameters(base: BaseModel, adapter: str) -> list[torch.nn.Parameter]:
    """The trainable tensors of one adapter, in a fixed order (the optimizer state depends on it)."""
    marker = f".{adapter}."
    return [p for n, p in base.model.named_parameters() if marker in n + "."]


def adapter_state_keys(base: BaseModel, adapter: str) -> list[str]:
    """peft's state-dict key of each tensor of ``adapter_parameters`` (same order)."""
    marker = f".{adapter}."
    keys = ["base_model.model." + n.replace(marker, ".") for n, _ in base.model.named_parameters()
            if marker in n + "."]
    with base.lock:
        expected = set(get_peft_model_state_dict(base.peft_model, adapter_name=adapter, save_embedding_layers=False))
    if set(keys) != expected:
        raise RuntimeError(f"peft state keys changed layout: {sorted(set(keys) ^ expected)[:3]}")
    return keys


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer body (hidden states) and the unembedding of a causal LM."""
    return model.get_decoder(), model.get_output_embeddings()


def cache_kwarg(body: torch.nn.Module) -> str:
    """The name of the KV-cache argument: transformers 5.24 renamed past_key_values to cache
    (the old name warns, and goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


def token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                   chunk: int = 256) -> torch.Tensor:
    """log p(target) at each row of ``hidden`` [N, H], with the log-softmax in float32.

    Chunked over rows so the float32 logits of a long batch never exist all at once.
    Trainer and sampler both call this, so their logprobs agree up to matmul shape effects.
    """
    out = []
    for start in range(0, hidden.shape[0], chunk):
        logits = head(hidden[start:start + chunk]).float()
        picked = logits.gather(-1, targets[start:start + chunk, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(logits, dim=-1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


class MergedAdapter:
    """A LoRA adapter for sampling, as weight deltas merged into a plain (not peft) model.

    Decoding runs one token at a time, where peft's per-layer LoRA ops (casts, two skinny
    matmuls, an add, in 200+ layers) cost more than the base matmuls themselves. Merging
    ``W + scale * B @ A`` (computed in float32) into the sampling model makes
    decoding run at base-model speed; switching adapters rewrites only the adapted layers.
    """

    def __init__(self, state: dict[str, torch.Tensor], config: LoraConfig):
        scale = config.lora_alpha / config.r
        self.deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for key, tensor in state.items():
            if key.endswith(".lora_A.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = state[key.replace(".lora_A.weight", ".lora_B.weight")]
                self.deltas[module] = (tensor.float(), b.float(), scale)
        if not self.deltas:
            raise ValueError("adapter state holds no LoRA tensors")


def _base_weight(model: torch.nn.Module, module: str) -> torch.Tensor:
    layer = model.get_submodule(module)
    return (layer.base_layer if isinstance(layer, BaseTunerLayer) else layer).weight


def sampling_model(base: BaseModel) -> torch.nn.Module:
    """The plain (never peft-wrapped) model that merged adapters are written into.

    It shares every weight with the base model; a layer gets a private weight only while an
    adapter's delta is merged into it (see ``merged``), so embeddings, norms and an unadapted
    (possibly tied) unembedding are never duplicated.
    """
    if base.sampling_model is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # no weights of its own: built empty, then pointed at the base model's tensors
            model = AutoModelForCausalLM.from_config(base.model.config, dtype=base.dtype)
        model.eval()
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            owner, _, attr = name.rpartition(".")
            source = base.model.get_submodule(owner)
            source = getattr(source.base_layer if isinstance(source, BaseTunerLayer) else source, attr)
            if isinstance(tensor, torch.nn.Parameter):
                model.get_submodule(owner).register_parameter(attr, torch.nn.Parameter(source.detach(),
                                                                                       requires_grad=False))
            else:
                model.get_submodule(owner).register_buffer(attr, source)
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            raise RuntimeError(f"base_model {base.name!r}: the sampling model has tensors the base model lacks")
        base.sampling_model = model
    return base.sampling_model


@contextlib.contextmanager
def merged(base: BaseModel, adapter: MergedAdapter | None) -> Iterator[torch.nn.Module]:
    """Run with ``adapter`` merged into the sampling model (None = the base weights); yields that model."""
    with base.lock, torch.no_grad():
        model = sampling_model(base)
        if base.merged_adapter is not adapter:
            previous = base.merged_adapter.deltas if base.merged_adapter is not None else {}
            wanted = adapter.deltas if adapter is not None else {}
            for module in set(previous) | set(wanted):
                layer = model.get_submodule(module)
                original = _base_weight(base.model, module)
                if module in wanted:
                    a, b, scale = wanted[module]
                    merged_weight = (original.float() + scale * (b @ a).to(original.device)).to(original.dtype)
                    if layer.weight.data_ptr() == original.data_ptr():  # still shared: make it private
                        layer.weight = torch.nn.Parameter(merged_weight, requires_grad=False)
                    else:
                        layer.weight.copy_(merged_weight)
                else:
                    layer.weight = torch.nn.Parameter(original.detach(), requires_grad=False)  # share again
            base.merged_adapter = adapter
        yield model
