"""mint: a local, MinT/Tinker-compatible LoRA training and sampling engine.

    import mint
    from mint import types
    service = mint.ServiceClient()
    tc = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=16)
"""

from mint import types
from mint.checkpoints import CheckpointError
from mint.futures import APIFuture
from mint.sampling import SamplingClient
from mint.service import ServiceClient
from mint.training import TrainingClient
from mint.types import *  # noqa: F401,F403  (the hosted API re-exports its types at top level)

__all__ = ["APIFuture", "CheckpointError", "SamplingClient", "ServiceClient", "TrainingClient", "types",
           *types.__all__]
