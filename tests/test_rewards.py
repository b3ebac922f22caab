"""The math reward and the problem sets."""

import json

import pytest

from rewards import datasets, get_reward
from rewards.math import extract_answer, math_reward


@pytest.mark.parametrize("text, answer, how", [
    ("The sum is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", "boxed"),
    ("so we get 7.\nAnswer: 12", "12", "answer"),
    ("The answer is 1,234.", "1234", "answer"),
    ("12", "12", "whole"),
    ("7 + 5 = 12", "12", "last_number"),
    ("no idea", None, "none"),
])
def test_answer_extraction(text, answer, how):
    assert extract_answer(text) == (answer, how)


def test_math_reward_uses_math_verify_equivalence_and_optional_format_bonus():
    assert math_reward("\\boxed{0.5}", {"answer": "\\frac{1}{2}"}) == 1.0
    assert math_reward("7 + 5 = 12", {"answer": "12"}) == 1.0
    assert math_reward("7 + 5 = 13", {"answer": "12"}) == 0.0
    assert math_reward("Answer: 12", {"answer": "12"}, format_bonus=0.2) == pytest.approx(1.2)
    assert math_reward("7 + 5 = 12", {"answer": "12"}, format_bonus=0.2) == 1.0  # correct, but not stated clearly
    with pytest.raises(ValueError, match="reward: unknown reward 'nope'"):
        get_reward("nope")


def test_arithmetic_eval_set_is_fixed_and_never_trained_on():
    held_out = {p["id"] for p in datasets.eval_set("arithmetic", 50)}
    assert held_out == {p["id"] for p in datasets.eval_set("arithmetic", 50)} and len(held_out) == 50
    trained = {p["id"] for seed in range(20) for p in datasets.train_batch("arithmetic", 64, seed)}
    assert not held_out & trained
    assert datasets.train_batch("arithmetic", 8, 3) == datasets.train_batch("arithmetic", 8, 3)
    with pytest.raises(ValueError, match="eval_size: 500 exceeds"):
        datasets.eval_set("arithmetic", 500)


def test_jsonl_datasets_hold_out_their_tail(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(30)) + "\n")
    evaluation = datasets.eval_set(str(path), 10)
    assert [p["answer"] for p in evaluation] == ["27", "28", "29"]
    assert all(int(p["answer"]) < 27 for p in datasets.train_batch(str(path), 50, 0))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: each line needs 'question' and 'answer'"):
        datasets.train_batch(str(bad), 1, 0)


def test_hub_datasets_fail_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not load 'openai/gsm8k'.*pass a .jsonl path"):
        datasets.train_batch("gsm8k", 1, 0)
    with pytest.raises(ValueError, match="dataset: unknown dataset 'nope'"):
        datasets.train_batch("nope", 1, 0)
