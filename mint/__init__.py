"""mint: a local, MinT/Tinker-compatible LoRA training and sampling engine.

    import mint
    from mint import grpo, types
    service = mint.ServiceClient()
    tc = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=16)
"""

from mint import grpo, types
from mint.checkpoints import CheckpointError
from mint.futures import APIFuture
from mint.sampling import SamplingClient
from mint.service import ServiceClient
from mint.training import TrainingClient
from mint.types import *

__all__ = ["APIFuture", "CheckpointError", "SamplingClient", "ServiceClient", "TrainingClient", "grpo", "types",
           *types.__all__]
