"""DAPO's options as pure functions and as task behaviour: overlong shaping, loss normalization,
dynamic sampling (keep mixed groups, with a cap), and the packaged AIME/MATH data."""

import pytest

from mint import grpo, types
from rewards import datasets
from rewards.math import math_reward
from tasks.common import read_json, write_json
from tasks.rollouts import keep_mixed_groups


def test_overlong_penalty_ramps_over_the_cache_to_minus_one_at_l_max():
    # L_max 20, L_cache 8: free up to 12 tokens, then linear to -1 at 20, -1 beyond.
    assert [grpo.overlong_penalty(n, 20, 8) for n in (5, 12, 16, 20, 25)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert grpo.overlong_penalty(16, 20, 8, factor=0.5) == -0.25
    assert grpo.overlong_penalty(100, 20, 0) == 0.0  # off
    with pytest.raises(ValueError, match="L_cache"):
        grpo.overlong_penalty(1, 20, 30)


def _datum(response_len: int, advantage: float) -> types.Datum:
    seq = types.SampledSequence(tokens=[1, 2, 3] + [4] * response_len, logprobs=[0.0] * (3 + response_len),
                                stop_reason="stop")
    return grpo.datum_from_sequence(seq, 3, advantage)


def test_token_normalization_divides_by_the_batchs_response_tokens():
    datums = [_datum(2, 1.0), _datum(6, -1.0)]
    token = grpo.normalize_advantages(datums, "token")
    assert token[0].loss_fn_inputs["advantages"].tolist()[-1] == pytest.approx(1 / 8)
    assert token[1].loss_fn_inputs["advantages"].tolist()[-1] == pytest.approx(-1 / 8)
    sequence = grpo.normalize_advantages(datums, "sequence")
    assert sequence[0].loss_fn_inputs["advantages"].tolist()[-1] == pytest.approx(1 / (2 * 2))
    assert sequence[1].loss_fn_inputs["advantages"].tolist()[-1] == pytest.approx(-1 / (6 * 2))
    assert grpo.normalize_advantages(datums, "sum") == datums
    with pytest.raises(ValueError, match="loss_normalization"):
        grpo.normalize_advantages(datums, "mean")


def _rollouts(key: str, n_groups: int):
    groups = [{"problem": {"id": f"{key}-{g}", "question": "?", "answer": "1"}, "prompt_tokens": [1, 2],
               "samples": [{"tokens": [3], "logprobs": [0.0], "stop_reason": "stop", "text": "1"}] * 2}
              for g in range(n_groups)]
    return write_json("rollouts", key, {"groups": groups})


def test_dynamic_sampling_keeps_the_first_mixed_groups_across_rounds(tmp_path, monkeypatch):
    monkeypatch.setenv("MINTFLOW_HOME", str(tmp_path))
    first, second = _rollouts("round-0", 3), _rollouts("round-1", 3)
    rewards = [[[1, 1], [0, 1], [0, 0]], [[1, 0], [1, 1], [0, 1]]]
    kept, kept_rewards, metrics = keep_mixed_groups.fn([first, second], rewards, groups_per_batch=2)
    assert [g["problem"]["id"] for g in read_json(kept)["groups"]] == ["round-0-1", "round-1-0"]
    assert kept_rewards == [[0, 1], [1, 0]]
    assert metrics == {"sampling_rounds": 2, "groups_sampled": 6, "groups_kept": 2}
    # The cap ran out before the batch was full: fewer groups, never a constant one.
    kept, kept_rewards, metrics = keep_mixed_groups.fn([first], rewards[:1], groups_per_batch=2)
    assert kept_rewards == [[0, 1]] and metrics["groups_kept"] == 1


def test_aime_and_math500_come_from_the_packaged_mmath_with_integer_answers():
    aime24, aime25 = datasets.eval_set("aime2024", 100), datasets.eval_set("aime2025", 100)
    assert len(aime24) == 30 and len(aime25) == 15
    assert all(p["answer"].isdigit() for p in aime24 + aime25)
    assert aime24[0]["answer"] == "204"  # AIME 2024 I problem 1 (Aya's walk)
    assert math_reward("so the walk takes 204 minutes.\nAnswer: 204", aime24[0]) == 1.0
    assert math_reward("\\boxed{204}", aime24[0]) == 1.0


def test_dapo_math_falls_back_to_packaged_problems_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets._dapo_math.cache_clear()
    pool = datasets.load_pool("dapo_math")
    assert len(pool) > 100 and all(p["answer"].lstrip("-").isdigit() for p in pool)
    datasets._dapo_math.cache_clear()
