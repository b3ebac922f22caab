"""ServiceClient: the entry point, as in MinT/Tinker, but local: no key, no server."""

from __future__ import annotations

import datetime
import json
import os
import secrets
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file

from mint import lora
from mint.checkpoints import CheckpointError, read_manifest
from mint.lora import DEFAULT_LORA_ALPHA
from mint.models import cache_dir, load_base_model
from mint.sampling import SamplingClient
from mint.training import ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_STATE, TrainingClient


class ServiceClient:
    """Creates training and sampling clients on models loaded in this process.

    ``checkpoint_dir``: where checkpoint names from ``save_state(name)`` go
    (default ``$MINTFLOW_CHECKPOINTS/<session>``, else ``$MINTFLOW_CACHE/checkpoints/<session>``);
    ``dtype``/``device`` override
    the defaults (bfloat16 on a CPU that supports it, else float32; CUDA when present).
    """

    def __init__(self, api_key: str | None = None, *, checkpoint_dir: str | os.PathLike | None = None,
                 dtype: str | torch.dtype | None = None, device: str | torch.device | None = None, **_ignored):
        session = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        root = Path(os.environ.get("MINTFLOW_CHECKPOINTS") or cache_dir() / "checkpoints")
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else root / session
        self.dtype = dtype
        self.device = device

    def _base(self, base_model: str):
        return load_base_model(base_model, self.dtype, self.device)

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    lora_alpha: int = DEFAULT_LORA_ALPHA) -> TrainingClient:
        return TrainingClient(self._base(base_model), rank, seed, train_mlp, train_attn, train_unembed,
                              self.checkpoint_dir, lora_alpha=lora_alpha, service=self)

    def create_training_client_from_state(self, path: str) -> TrainingClient:
        """A training client that continues from a ``save_state`` checkpoint (weights and optimizer)."""
        manifest = read_manifest(path)
        config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
        targets = set(config["target_modules"])
        client = self.create_lora_training_client(
            manifest["base_model"], rank=manifest["rank"], lora_alpha=config["lora_alpha"],
            train_mlp=bool(targets & set(lora.MLP_MODULES)), train_attn=bool(targets & set(lora.ATTN_MODULES)),
            train_unembed=bool(targets & set(lora.UNEMBED_MODULES)))
        load = client.load_state_with_optimizer if OPTIMIZER_STATE in manifest["files"] else client.load_state
        load(path).result()
        return client

    def create_sampling_client(self, base_model: str | None = None, model_path: str | None = None) -> SamplingClient:
        """Sample from ``base_model``, or from the LoRA weights saved at ``model_path`` on their base model."""
        if model_path is None:
            if base_model is None:
                raise ValueError("create_sampling_client: give base_model, model_path, or both")
            return SamplingClient(self._base(base_model))
        manifest = read_manifest(model_path)
        saved_base = manifest["base_model"]
        if base_model is not None and base_model != saved_base:
            raise CheckpointError(f"model_path {model_path!r} was trained on {saved_base!r}, not {base_model!r}")
        base = self._base(saved_base)
        adapter = lora.MergedAdapter(load_file(str(Path(model_path) / ADAPTER_WEIGHTS)),
                                     LoraConfig.from_pretrained(model_path))
        return SamplingClient(base, adapter=adapter, model_path=str(model_path))

    def get_server_capabilities(self) -> dict:
        return {"supported_models": ["any local transformers folder, .gguf file or cached hub id"],
                "losses": ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]}
