"""The MinT / Tinker data types (see shared/API.md).

Scripts written for the hosted service build these objects; the local engine
reads them. Validation happens here, at construction, so a malformed request is
refused with the offending field named before any model state is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "LoadWeightsResponse",
    "ModelInput",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "SaveWeightsResponse",
    "StopReason",
    "TensorData",
]

DType = Literal["int64", "float32"]
StopReason = Literal["stop", "length"]

# loss_fn_inputs that hold token ids; everything else is float32.
INT_INPUT_NAMES = frozenset({"target_tokens"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class TensorData(_Model):
    """A flat or shaped array sent over the API: ``data`` is a flat list, ``shape`` its shape."""

    data: list[int] | list[float]
    dtype: DType
    shape: list[int] | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> TensorData:
        if self.shape is not None and int(np.prod(self.shape)) != len(self.data):
            raise ValueError(f"TensorData.shape {self.shape} does not match {len(self.data)} data elements")
        return self

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = _dtype_name(array.dtype)
        return cls(data=array.reshape(-1).tolist(), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().numpy() if tensor.dtype != torch.bfloat16
                              else tensor.detach().float().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=np.int64 if self.dtype == "int64" else np.float32)
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self) -> torch.Tensor:
        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def __len__(self) -> int:
        return self.shape[0] if self.shape else len(self.data)


def _dtype_name(dtype: Any) -> DType:
    kind = np.dtype(dtype).kind
    if kind in "iub":
        return "int64"
    if kind == "f":
        return "float32"
    raise TypeError(f"TensorData supports integer and float arrays, got dtype {dtype}")


def to_tensor_data(value: Any, name: str) -> TensorData:
    """Convert a list, numpy array, torch tensor or TensorData into TensorData.

    ``target_tokens`` is stored as int64 and every other input as float32, as the
    hosted API does.
    """
    dtype: DType = "int64" if name in INT_INPUT_NAMES else "float32"
    if isinstance(value, dict):  # a serialized TensorData (model_dump / JSON)
        value = TensorData.model_validate(value)
    if isinstance(value, TensorData):
        array = value.to_numpy()
    elif isinstance(value, torch.Tensor):
        array = value.detach().float().cpu().numpy() if value.dtype == torch.bfloat16 else value.detach().cpu().numpy()
    elif isinstance(value, (np.ndarray, list, tuple)):
        try:
            array = np.asarray(value)
        except ValueError as e:
            raise ValueError(f"loss_fn_inputs[{name!r}] is not a rectangular array: {e}") from None
    else:
        raise ValueError(
            f"loss_fn_inputs[{name!r}] must be a list, numpy array, torch tensor or TensorData, "
            f"got {type(value).__name__}"
        )
    if array.dtype.kind not in "iubf":
        raise ValueError(f"loss_fn_inputs[{name!r}] must hold numbers, got dtype {array.dtype}")
    if dtype == "int64":
        if array.dtype.kind == "f":
            if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
                raise ValueError(f"loss_fn_inputs[{name!r}] must hold integer token ids")
        array = array.astype(np.int64)
    else:
        array = array.astype(np.float32)
    return TensorData(data=array.reshape(-1).tolist(), dtype=dtype, shape=list(array.shape))


class EncodedTextChunk(_Model):
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class ModelInput(_Model):
    """A model input: a list of chunks (only token chunks run locally)."""

    chunks: list[EncodedTextChunk]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append_int(self, token: int) -> ModelInput:
        """A new ModelInput with ``token`` appended (the original is unchanged)."""
        return ModelInput.from_ints(self.to_ints() + [int(token)])

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput(chunks=[*self.chunks, chunk])


class Datum(_Model):
    """One training example: the input tokens and per-position loss inputs.

    Every ``loss_fn_inputs`` entry is a per-position array of length
    ``model_input.length`` (checked when the datum is used, where the error can name it).
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]

    @field_validator("loss_fn_inputs", mode="before")
    @classmethod
    def _convert_inputs(cls, value: Any) -> dict[str, TensorData]:
        if not isinstance(value, dict):
            raise ValueError(f"loss_fn_inputs must be a dict of name -> array, got {type(value).__name__}")
        return {str(name): to_tensor_data(v, str(name)) for name, v in value.items()}


class AdamParams(_Model):
    learning_rate: float = Field(1e-4, ge=0.0, allow_inf_nan=False)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    grad_clip_norm: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="0 means no clipping")


class SamplingParams(_Model):
    max_tokens: int | None = Field(None, ge=0, description="new tokens at most; None = up to the context limit")
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="0 = greedy")
    top_k: int = Field(-1, ge=-1, description="-1 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0)

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return value

    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop or [] if isinstance(s, str)]

    def stop_ids(self) -> list[int]:
        ids = [s for s in self.stop or [] if isinstance(s, int)] if not isinstance(self.stop, str) else []
        return ids + list(self.stop_token_ids or [])


class SampledSequence(_Model):
    tokens: list[int]
    logprobs: list[float] | None = None
    stop_reason: StopReason


class SampleResponse(_Model):
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


class ForwardBackwardOutput(_Model):
    loss_fn_output_type: str = "TensorData"
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


class OptimStepResponse(_Model):
    metrics: dict[str, float] = Field(default_factory=dict)


class SaveWeightsResponse(_Model):
    path: str


class LoadWeightsResponse(_Model):
    path: str


class GetInfoResponse(_Model):
    model_name: str
    lora_rank: int
    model_data: dict[str, Any] = Field(default_factory=dict)
