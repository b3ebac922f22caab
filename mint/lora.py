"""LoRA adapters on a shared base model (peft), and the forward pass both clients use.

All clients of a process share one base model; each holds its own named peft
adapter on it (like vLLM's multi-LoRA), so a sampling client is a few MB, not a
copy of the model. The adapter to run is picked under the base model's lock.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

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
    return name


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
def active(base: BaseModel, adapter: str | None) -> Iterator[torch.nn.Module]:
    """Run the base model with ``adapter`` (None = plain base weights); yields the HF model."""
    with base.lock:
        if adapter is None:
            if base.peft_model is None:
                yield base.model
            else:
                with base.peft_model.disable_adapter():
                    yield base.model
            return
        if base.active_adapter != adapter:
            base.peft_model.base_model.set_adapter(adapter, inference_mode=True)
            base.active_adapter = adapter
        yield base.model


def adapter_parameters(base: BaseModel, adapter: str) -> list[torch.nn.Parameter]:
    """The trainable tensors of one adapter, in a fixed order (the optimizer state depends on it)."""
    marker = f".{adapter}."
    return [p for n, p in base.model.named_parameters() if marker in n + "."]


def adapter_state(base: BaseModel, adapter: str) -> dict[str, torch.Tensor]:
    with base.lock:
        # The unembedding is tied to the (frozen) embedding: save only the LoRA tensors, not a 28M-row copy.
        state = get_peft_model_state_dict(base.peft_model, adapter_name=adapter, save_embedding_layers=False)
        return {k: v.detach().clone().contiguous() for k, v in state.items()}


def load_adapter_state(base: BaseModel, adapter: str, state: dict[str, torch.Tensor]) -> None:
    with base.lock:
        result = set_peft_model_state_dict(base.peft_model, state, adapter_name=adapter)
        missing = [k for k in getattr(result, "missing_keys", []) if f".{adapter}." in k]
        unexpected = list(getattr(result, "unexpected_keys", []))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not fit this adapter: missing {missing[:3]}, unexpected {unexpected[:3]}")


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer body (hidden states) and the unembedding of a causal LM."""
    return model.get_decoder(), model.get_output_embeddings()


def token_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                   chunk: int = 1024) -> torch.Tensor:
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
