"""Sampling on vLLM (GPU; the optional ``vllm`` extra).

One vLLM engine per process, colocated with training on the same GPU (it takes
``gpu_memory_utilization`` of the memory). The base model is loaded once; each policy
checkpoint's LoRA adapter is handed to vLLM per request with a ``LoRARequest`` whose id is
derived from the checkpoint's content, so a new iteration's adapter is loaded once and an old
one is evicted. Returns the same ``SampleResponse`` as the transformers backend: tokens,
the sampler's logprob of each, and the stop reason.

What does not need CUDA (mapping our SamplingParams, converting vLLM's outputs, exporting an
adapter as vLLM loads it) is plain functions, tested on the CPU.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import shutil
import threading
from pathlib import Path
from typing import Any

from mint.checkpoints import read_manifest
from mint.futures import APIFuture
from mint.types import ModelInput, SampledSequence, SampleResponse, SamplingParams

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def vllm_sampling_kwargs(params: SamplingParams, num_samples: int, stop_token_ids: list[int]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` equivalent to ours (``logprobs=0``: the sampled token's only)."""
    kwargs: dict[str, Any] = {"n": num_samples, "temperature": params.temperature, "top_p": params.top_p,
                              "max_tokens": params.max_tokens, "seed": params.seed, "logprobs": 0,
                              "stop_token_ids": sorted(set(params.stop_ids()) | set(stop_token_ids))}
    if params.top_k != -1:
        kwargs["top_k"] = params.top_k
    if params.stop_strings():
        kwargs["stop"] = params.stop_strings()
    return kwargs


def to_sample_response(request_output: Any) -> SampleResponse:
    """Our SampleResponse from a vLLM ``RequestOutput``: token ids, their logprobs, 'stop' or 'length'."""
    sequences = []
    for completion in request_output.outputs:
        tokens = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]
        sequences.append(SampledSequence(tokens=tokens, logprobs=logprobs,
                                         stop_reason="length" if completion.finish_reason == "length" else "stop"))
    return SampleResponse(sequences=sequences)


def export_adapter(checkpoint: str | Path, out: str | Path, max_lora_rank: int = 64) -> Path:
    """The checkpoint's LoRA adapter as vLLM loads it: peft's two files, nothing else.

    vLLM serves LoRA on the attention and MLP projections only, so an adapter that also
    trains the unembedding (``train_unembed``) is refused, as is a rank above ``max_lora_rank``.
    """
    checkpoint = Path(checkpoint)
    read_manifest(checkpoint)  # verified: complete and unmodified
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    targets = config.get("target_modules") or []
    if "lm_head" in targets or config.get("modules_to_save"):
        raise ValueError(f"checkpoint {checkpoint}: its adapter trains the unembedding (train_unembed), which "
                         "vLLM does not serve; train with train_unembed=false to sample with vLLM")
    if int(config["r"]) > max_lora_rank:
        raise ValueError(f"checkpoint {checkpoint}: LoRA rank {config['r']} exceeds max_lora_rank {max_lora_rank}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copyfile(checkpoint / name, out / name)
    return out


def adapter_id(checkpoint: str | Path) -> int:
    """A positive int identifying the checkpoint's content (vLLM caches adapters by this id)."""
    manifest = read_manifest(checkpoint)
    digest = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:7], "little") + 1


_engines: dict[tuple, Any] = {}
_engines_lock = threading.Lock()


def engine(weights: str, gpu_memory_utilization: float = 0.5, max_lora_rank: int = 64,
           max_model_len: int | None = None):
    """The process's vLLM engine for ``weights`` (created once)."""
    key = (weights, gpu_memory_utilization, max_lora_rank, max_model_len)
    with _engines_lock:
        if key not in _engines:
            try:
                from vllm import LLM
            except ImportError:
                raise RuntimeError("sampler 'vllm' needs vLLM on a CUDA machine: pip install -e '.[vllm]'") from None
            _engines[key] = LLM(model=weights, enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1,
                                gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                dtype="bfloat16", enable_prefix_caching=True)
        return _engines[key]


class VLLMSamplingClient:
    """SamplingClient on vLLM: ``sample`` returns an APIFuture of a SampleResponse, like the default backend."""

    def __init__(self, weights: str, tokenizer, stop_token_ids: list[int], model_path: str | None = None,
                 gpu_memory_utilization: float = 0.5, max_lora_rank: int = 64):
        self.weights, self.tokenizer, self.stop_token_ids = weights, tokenizer, stop_token_ids
        self.model_path = model_path
        self._pending: list[tuple[list[int], dict, concurrent.futures.Future]] = []
        self._lock = threading.Lock()
        self._engine = engine(weights, gpu_memory_utilization, max_lora_rank)
        self._lora = None
        if model_path is not None:
            from vllm.lora.request import LoRARequest

            exported = export_adapter(model_path, Path(model_path).parent / f".vllm-{Path(model_path).name}",
                                      max_lora_rank)
            self._lora = LoRARequest(f"policy-{adapter_id(model_path)}", adapter_id(model_path), str(exported))

    def get_tokenizer(self):
        return self.tokenizer

    def sample(self, prompt: ModelInput, num_samples: int = 1,
               sampling_params: SamplingParams | None = None) -> APIFuture[SampleResponse]:
        """Queue a request; the first ``result()`` sends every queued one to vLLM in one batch."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pending.append((prompt.to_ints(), vllm_sampling_kwargs(params, num_samples, self.stop_token_ids),
                                  future))
        return APIFuture(future, before_wait=self._run_pending)

    def _run_pending(self) -> None:
        from vllm import SamplingParams as VLLMParams

        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            outputs = self._engine.generate([{"prompt_token_ids": ids} for ids, _, _ in pending],
                                            [VLLMParams(**kwargs) for _, kwargs, _ in pending],
                                            lora_request=self._lora, use_tqdm=False)
            for (_, _, future), output in zip(pending, outputs, strict=True):
                future.set_result(to_sample_response(output))
        except Exception as e:
            for _, _, future in pending:
                if not future.done():
                    future.set_exception(e)
