"""mint.types: conversions, validation, and the seed's Datum snippet run verbatim."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import mint
from mint import grpo, types


def test_datum_accepts_lists_numpy_torch_and_tensordata_alike():
    tokens = [5, 6, 7]
    forms = [
        [1, 2, 3],
        np.array([1, 2, 3]),
        torch.tensor([1, 2, 3]),
        types.TensorData(data=[1, 2, 3], dtype="int64", shape=[3]),
    ]
    for form in forms:
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                            loss_fn_inputs={"target_tokens": form, "weights": form})
        assert datum.loss_fn_inputs["target_tokens"].dtype == "int64"
        assert datum.loss_fn_inputs["weights"].dtype == "float32"
        assert datum.loss_fn_inputs["target_tokens"].tolist() == [1, 2, 3]
        assert datum.loss_fn_inputs["weights"].to_torch().dtype == torch.float32


def test_tensordata_round_trips():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = types.TensorData.from_numpy(array)
    assert data.shape == [2, 3] and data.dtype == "float32"
    assert np.array_equal(data.to_numpy(), array)
    assert torch.equal(types.TensorData.from_torch(torch.tensor([1, 2])).to_torch(), torch.tensor([1, 2]))
    assert types.TensorData.from_torch(torch.tensor([0.5], dtype=torch.bfloat16)).tolist() == [0.5]
    with pytest.raises(ValidationError, match="does not match"):
        types.TensorData(data=[1, 2], dtype="int64", shape=[3])


def test_target_tokens_must_be_integers():
    with pytest.raises(ValidationError, match="integer token ids"):
        types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [1.5]})
    with pytest.raises(ValidationError, match="must be a list, numpy array"):
        types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"weights": "abc"})


def test_model_input():
    mi = types.ModelInput.from_ints([1, 2])
    assert mi.length == 2 and mi.to_ints() == [1, 2]
    assert mi.append_int(3).to_ints() == [1, 2, 3] and mi.length == 2
    assert types.ModelInput.empty().length == 0
    chunks = [types.EncodedTextChunk(tokens=[1]), types.EncodedTextChunk(tokens=[2])]
    assert types.ModelInput(chunks=chunks).to_ints() == [1, 2]


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"temperatur": 1.0}, "temperatur"),
])
def test_sampling_params_out_of_range_name_the_field(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        types.SamplingParams(**kwargs)


def test_sampling_params_stop_forms():
    assert types.SamplingParams(stop="\n").stop_strings() == ["\n"]
    assert types.SamplingParams(stop=[7, 8], stop_token_ids=[9]).stop_ids() == [7, 8, 9]
    assert types.SamplingParams(stop=["a", "b"]).stop_ids() == []


@pytest.mark.parametrize("kwargs", [{"learning_rate": -1.0}, {"beta1": 1.0}, {"eps": 0.0}, {"grad_clip_norm": -1}])
def test_adam_params_validation(kwargs):
    with pytest.raises(ValidationError, match=next(iter(kwargs))):
        types.AdamParams(**kwargs)


def test_types_are_reexported_at_top_level():
    assert mint.Datum is types.Datum and mint.SamplingParams is types.SamplingParams


def test_seed_snippet_runs_verbatim():
    """The Datum-building code of seed/RL-GRPO.md, copied as is."""
    prompt = [11, 12, 13, 14]
    samples = [types.SampledSequence(tokens=[21, 22, 2], logprobs=[-0.5, -0.25, -0.125], stop_reason="stop"),
               types.SampledSequence(tokens=[23, 2], logprobs=[-1.0, -0.1], stop_reason="stop")]
    sequences = [grpo.full_sequence(prompt, s) for s in samples]
    rewards = [1.0, 0.0]
    num_samples = len(sequences)
    prompt_len = len(prompt)
    datums = []

    # --- verbatim from the seed ---
    mean_r = sum(rewards) / num_samples
    for i, (seq, reward) in enumerate(zip(sequences, rewards)):  # noqa: B007
        advantage = reward - mean_r
        response_len = len(seq.tokens) - prompt_len
        advantages   = [0.0] * (prompt_len - 1) + [advantage] * response_len
        datums.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens=seq.tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": seq.tokens[1:],
                "weights":       [0.0] * (prompt_len - 1) + [1.0] * response_len,
                "logprobs":      seq.logprobs[1:],
                "advantages":   advantages,
            },
        ))
    # --- end of seed ---

    assert [d.model_dump() for d in datums] == [d.model_dump() for d in grpo.group_datums(prompt, samples, rewards)]
    first = datums[0]
    assert first.model_input.to_ints() == [11, 12, 13, 14, 21, 22]
    assert first.loss_fn_inputs["target_tokens"].tolist() == [12, 13, 14, 21, 22, 2]
    assert first.loss_fn_inputs["weights"].tolist() == [0, 0, 0, 1, 1, 1]
    assert first.loss_fn_inputs["logprobs"].tolist() == [0, 0, 0, -0.5, -0.25, -0.125]
    assert first.loss_fn_inputs["advantages"].tolist() == [0, 0, 0, 0.5, 0.5, 0.5]
    for d in datums:
        assert all(len(v) == d.model_input.length for v in d.loss_fn_inputs.values())


def test_group_advantages_center_on_the_mean():
    assert grpo.group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert grpo.is_constant([1.0, 1.0]) and not grpo.is_constant([0.0, 1.0])


def test_kl_penalty_is_folded_into_advantages():
    datum = grpo.datum_from_sequence(
        types.SampledSequence(tokens=[1, 2, 3, 4], logprobs=[0.0, 0.0, -1.0, -2.0], stop_reason="stop"), 2, 0.0)
    # response targets are tokens 3 and 4 (positions 1, 2); d = sampled - ref there.
    ref = [0.0, -1.5, -1.0]
    (new,), mean_kl = grpo.incorporate_kl_penalty([datum], [ref], coef=1.0)
    d = np.array([0.0, 0.5, -1.0])
    assert mean_kl == pytest.approx((0.5 - 1.0) / 2)
    expected = np.where([False, True, True], mean_kl - d, 0.0)
    assert np.allclose(new.loss_fn_inputs["advantages"].to_numpy(), expected)
