"""Task bodies on their own (``task.fn``): advantages, KL folding, constant groups, artifacts."""

import pytest
from conftest import chat_prompt

from mint import types
from tasks.common import Artifact, read_json, write_json
from tasks.rollouts import compute_advantages, instructions_followed

pytestmark = pytest.mark.model


@pytest.fixture
def rollouts(tokenizer, service):
    sampler = service.create_sampling_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    groups = []
    for i, question in enumerate(["What is 1 + 1?", "What is 2 + 5?"]):
        prompt = chat_prompt(tokenizer, question)
        out = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                             types.SamplingParams(max_tokens=4, temperature=1.0, seed=i)).result()
        groups.append({"problem": {"id": f"p{i}", "question": question, "answer": "2"}, "prompt_tokens": prompt,
                       "samples": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason,
                                    "text": tokenizer.decode(s.tokens)} for s in out.sequences]})
    return write_json("rollouts", "test-rollouts", {"groups": groups})


def test_advantages_center_rewards_and_can_drop_constant_groups(rollouts):
    rewards = [[1.0, 0.0], [1.0, 1.0]]
    batch, metrics = compute_advantages.fn(rollouts, rewards, base_model="embedded", kl_penalty_coef=0.0,
                                           remove_constant_reward_groups=False)
    datums = [types.Datum.model_validate(d) for d in read_json(batch)["datums"]]
    assert len(datums) == 4 and metrics["frac_mixed"] == 0.5 and metrics["frac_all_good"] == 0.5
    assert max(datums[0].loss_fn_inputs["advantages"].tolist()) == 0.5
    assert max(abs(a) for a in datums[2].loss_fn_inputs["advantages"].tolist()) == 0.0
    kept, metrics = compute_advantages.fn(rollouts, rewards, base_model="embedded", kl_penalty_coef=0.0,
                                          remove_constant_reward_groups=True)
    assert metrics["num_datums"] == 2


def test_kl_penalty_against_the_base_model_changes_advantages(rollouts):
    rewards = [[1.0, 0.0], [0.0, 1.0]]
    plain, _ = compute_advantages.fn(rollouts, rewards, base_model="embedded", kl_penalty_coef=0.0,
                                     remove_constant_reward_groups=False)
    with_kl, metrics = compute_advantages.fn(rollouts, rewards, base_model="embedded", kl_penalty_coef=1.0,
                                             remove_constant_reward_groups=False)
    # The samples came from the base model itself, so their KL to it is ~0 (bf16 noise only) ...
    assert abs(metrics["kl_to_base"]) < 0.1
    a = [d["loss_fn_inputs"]["advantages"]["data"] for d in read_json(plain)["datums"]]
    b = [d["loss_fn_inputs"]["advantages"]["data"] for d in read_json(with_kl)["datums"]]
    # ... and the penalty only moves response positions (weight 1), by a small amount.
    weights = [d["loss_fn_inputs"]["weights"]["data"] for d in read_json(plain)["datums"]]
    for x, y, w in zip(a, b, weights):
        assert all(xi == yi for xi, yi, wi in zip(x, y, w) if wi == 0)
        assert all(abs(xi - yi) < 0.5 for xi, yi in zip(x, y))


def test_a_corrupted_artifact_is_refused(rollouts):
    with open(rollouts.path, "a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match="is corrupted"):
        read_json(rollouts)
    with pytest.raises(FileNotFoundError):
        read_json(Artifact(path=rollouts.path + ".missing", digest="x"))


def test_instructions_followed_is_the_share_of_constraints_met_by_replies_that_have_them():
    replies = [({"constraints": [{"kind": "no_commas"}]}, "red, green"),
               ({"constraints": [{"kind": "no_commas"}, {"kind": "max_words", "value": 1}]}, "red green"),
               ({"question": "no instruction"}, "anything")]
    assert instructions_followed(replies) == [0.0, 0.5]
