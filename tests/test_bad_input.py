"""Malformed requests raise a clear error naming the field, and leave the client untouched."""

import pytest
import torch
from conftest import EMBEDDED, grads_snapshot, lora_snapshot, sft_datum
from pydantic import ValidationError

import mint
from mint import types

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def trained(service, tokenizer):
    """A client with weights, pending gradients and Adam state, all of which must survive bad requests."""
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0)
    data = [sft_datum(tokenizer, "What is 2 + 2?", "4"), sft_datum(tokenizer, "Name a color.", "Red")]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    tc.forward_backward(data, "cross_entropy").result()  # gradients pending
    return tc, data


def rl_datum(n=5, **overrides):
    inputs = {"target_tokens": [1] * n, "logprobs": [-1.0] * n, "advantages": [0.5] * n, "weights": [1.0] * n}
    inputs.update(overrides)
    inputs = {k: v for k, v in inputs.items() if v is not None}
    return types.Datum(model_input=types.ModelInput.from_ints([1] * n), loss_fn_inputs=inputs)


BAD_REQUESTS = [
    ("wrong length", lambda: [rl_datum(advantages=[0.5] * 4)], "importance_sampling", None,
     r"loss_fn_inputs\['advantages'\]: shape \[4\], expected \[5\]"),
    ("missing input", lambda: [rl_datum(advantages=None)], "importance_sampling", None, "missing 'advantages'"),
    ("unknown input", lambda: [rl_datum(advantage=[0.0] * 5)], "importance_sampling", None,
     "unknown input 'advantage'"),
    ("unknown loss", lambda: [rl_datum()], "grpo", None, "loss_fn: unknown loss"),
    ("unknown config key", lambda: [rl_datum()], "ppo", {"clip": 0.1}, "loss_fn_config: unknown key 'clip'"),
    ("token out of vocab", lambda: [rl_datum(target_tokens=[1, 2, 3, 4, 10**6])], "importance_sampling", None,
     r"target_tokens: token id 1000000 is outside the vocabulary"),
    ("negative token", lambda: [types.Datum(model_input=types.ModelInput.from_ints([1, -3]),
                                            loss_fn_inputs={"target_tokens": [1, 1]})], "cross_entropy", None,
     "model_input: token id -3"),
    ("empty data", list, "cross_entropy", None, "data: expected a non-empty list"),
    ("empty datum", lambda: [types.Datum(model_input=types.ModelInput.empty(), loss_fn_inputs={"target_tokens": []})],
     "cross_entropy", None, r"data\[0\].model_input: empty"),
    ("nan advantages", lambda: [rl_datum(advantages=[0.5, float("nan"), 0.5, 0.5, 0.5])], "importance_sampling", None,
     r"loss_fn_inputs\['advantages'\]: contains NaN"),
    ("inf logprobs", lambda: [rl_datum(logprobs=[-float("inf")] * 5)], "importance_sampling", None,
     r"loss_fn_inputs\['logprobs'\]: contains NaN or infinite"),
    ("not a datum", lambda: [{"model_input": [1, 2]}], "cross_entropy", None, r"data\[0\]: expected types.Datum"),
]


@pytest.mark.parametrize("case, make_data, loss_fn, config, message", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_training_requests_leave_weights_gradients_and_optimizer_unchanged(trained, case, make_data, loss_fn,
                                                                                config, message):
    tc, _ = trained
    weights, grads = lora_snapshot(tc), grads_snapshot(tc)
    optimizer = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)} for k, v in tc._optimizer.state.items()}
    with pytest.raises((ValueError, TypeError), match=message):
        tc.forward_backward(make_data(), loss_fn, config).result()
    assert all(torch.equal(v, weights[k]) for k, v in lora_snapshot(tc).items())
    assert all((g is None and grads[k] is None) or torch.equal(g, grads[k]) for k, g in grads_snapshot(tc).items())
    for key, state in tc._optimizer.state.items():
        assert all(torch.equal(t, optimizer[key][n]) for n, t in state.items() if torch.is_tensor(t))


def test_bad_checkpoint_paths(trained, tmp_path):
    tc, _ = trained
    weights = lora_snapshot(tc)
    with pytest.raises(mint.CheckpointError, match="does not exist"):
        tc.load_state(str(tmp_path / "nope")).result()
    path = tc.save_state(str(tmp_path / "ckpt")).result().path
    weights_file = tmp_path / "ckpt" / "adapter_model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    with pytest.raises(mint.CheckpointError, match="adapter_model.safetensors is truncated"):
        tc.load_state_with_optimizer(path).result()
    (tmp_path / "ckpt" / "manifest.json").unlink()
    with pytest.raises(mint.CheckpointError, match="never completed"):
        tc.load_state(path).result()
    assert all(torch.equal(v, weights[k]) for k, v in lora_snapshot(tc).items())


def test_sampler_checkpoint_has_no_optimizer_state(trained, tmp_path):
    tc, _ = trained
    path = tc.save_weights_for_sampler(str(tmp_path / "weights-only")).result().path
    with pytest.raises(mint.CheckpointError, match="sampler weights only"):
        tc.load_state_with_optimizer(path)


def test_unknown_base_model(service):
    with pytest.raises(ValueError, match="base_model: unknown model 'no-such-org/no-such-model'"):
        service.create_lora_training_client("no-such-org/no-such-model")
    with pytest.raises(ValueError, match="base_model: '/nonexistent/model.gguf' does not exist"):
        service.create_sampling_client(base_model="/nonexistent/model.gguf")


@pytest.mark.parametrize("kwargs, message", [
    ({"num_samples": 0}, "num_samples: expected an integer >= 1"),
    ({"sampling_params": types.SamplingParams(max_tokens=10**9)}, "sampling_params.max_tokens: 1000000000"),
    ({"prompt": types.ModelInput.from_ints([10**6])}, "prompt: token id 1000000 is outside"),
    ({"prompt": types.ModelInput.empty()}, "prompt: empty"),
    ({"sampling_params": types.SamplingParams(stop=[10**7])}, "sampling_params.stop: token id"),
])
def test_bad_sampling_requests(service, tokenizer, kwargs, message):
    sc = service.create_sampling_client(base_model=EMBEDDED)
    args = {"prompt": types.ModelInput.from_ints([1, 2, 3]), "num_samples": 1,
            "sampling_params": types.SamplingParams(max_tokens=2), **kwargs}
    with pytest.raises(ValueError, match=message):
        sc.sample(**args)


@pytest.mark.parametrize("kwargs", [{"max_tokens": -1}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.01}])
def test_sampling_params_out_of_range(kwargs):
    with pytest.raises(ValidationError, match=next(iter(kwargs))):
        types.SamplingParams(**kwargs)


def test_bad_rank(service):
    with pytest.raises(ValueError, match="rank: LoRA rank must be an integer >= 1"):
        service.create_lora_training_client(EMBEDDED, rank=0)
