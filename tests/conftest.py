"""Shared fixtures. Tests run offline and write only to temporary folders (plus the model cache)."""

import atexit
import os
import shutil
import socket
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Prefect and MLflow get temporary homes; nothing a test does lands in the user's.
_HOME = tempfile.mkdtemp(prefix="mintflow-tests-")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)  # checkpoints of a full run take ~0.5 GB
os.environ["PREFECT_HOME"] = os.path.join(_HOME, "prefect")
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = os.path.join(_HOME, "prefect", "storage")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["MINTFLOW_HOME"] = os.path.join(_HOME, "data")
os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///" + os.path.join(_HOME, "mlflow.db")
os.environ.pop("PREFECT_API_URL", None)

import pytest
import torch

import mint
from mint import types

EMBEDDED = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    return mint.ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def service_fp32(tmp_path_factory):
    return mint.ServiceClient(checkpoint_dir=tmp_path_factory.mktemp("checkpoints32"), dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(service):
    return service.create_sampling_client(base_model=EMBEDDED).get_tokenizer()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for servers a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=False)


def sft_datum(tokenizer, question: str, answer: str) -> types.Datum:
    prompt = chat_prompt(tokenizer, question)
    completion = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
    tokens = prompt + completion
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(completion)})


def lora_snapshot(client) -> dict[str, torch.Tensor]:
    return {str(i): p.detach().clone() for i, p in enumerate(client._params)}


def grads_snapshot(client) -> dict[str, torch.Tensor | None]:
    return {str(i): None if p.grad is None else p.grad.clone() for i, p in enumerate(client._params)}


@pytest.fixture(scope="module")
def harness():
    """A Prefect test server for the module's flows; it stops with the module (an ephemeral one outlived pytest)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield
