"""Fan-out stages on other task runners: scoring split in shards gives the same rewards on Prefect's
thread pool, on a local Dask cluster and on a local Ray cluster (worker processes)."""

import pytest
from prefect import flow

from flows.grpo import StageRunner
from tasks.common import write_json
from tasks.rollouts import score

REPLIES = ["The answer is 7.", "7", "\\boxed{8}", "no idea", "Answer: 12", "12!", "eleven", "13"]


@pytest.fixture
def rollouts(tmp_path, monkeypatch):
    monkeypatch.setenv("MINTFLOW_HOME", str(tmp_path))
    groups = [{"problem": {"id": f"add-{g}", "question": "?", "answer": str(7 + (g % 2) * 5)},
               "samples": [{"text": REPLIES[(g * 3 + i) % len(REPLIES)]} for i in range(2)]} for g in range(5)]
    return write_json("rollouts", "scale-test", {"groups": groups})


@flow
def scoring(rollouts, runner: str, shards: int) -> list:
    return StageRunner().fan_out(score, runner, shards, rollouts=rollouts, reward="math", reward_options={})


def test_shards_are_interleaved_back_into_group_order(harness, rollouts):
    from rewards import get_reward
    from tasks.common import read_json

    reward = get_reward("math")
    expected = [[float(reward(s["text"], g["problem"])) for s in g["samples"]] for g in read_json(rollouts)["groups"]]
    assert {r for group in expected for r in group} == {0.0, 1.0}  # a real mix, so order matters
    assert scoring(rollouts, "threads", 1) == expected
    assert scoring(rollouts, "threads", 3) == expected


def test_scoring_on_a_local_dask_cluster_equals_the_thread_pool(harness, rollouts):
    assert scoring(rollouts, "dask", 2) == scoring(rollouts, "threads", 1)


def test_scoring_on_a_local_ray_cluster_equals_the_thread_pool(harness, rollouts):
    assert scoring(rollouts, "ray", 2) == scoring(rollouts, "threads", 1)
