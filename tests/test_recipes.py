"""Every recipe beyond arithmetic runs through the same GRPO flow, tiny-sized: code RL scored in
the sandbox, chat RL graded by the judge, and the dapo-aime CPU smoke with every DAPO option."""

import shutil

import pytest
from mlflow.tracking import MlflowClient

from flows.config import build_config
from flows.grpo import grpo

pytestmark = pytest.mark.model
TINY = ["iterations=2", "groups_per_batch=2", "group_size=2", "eval_every=0"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MINTFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "home"


def _metrics(summary: dict) -> dict[str, list[float]]:
    client = MlflowClient(summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    return {name: [m.value for m in client.get_metric_history(run.info.run_id, name)] for name in run.data.metrics}


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make setup installs it)")
def test_code_recipe_scores_replies_in_the_sandbox(harness, home):
    summary = grpo(build_config("code", TINY + ["eval_size=4", "max_tokens=32", "sft.steps=2"]))
    metrics = _metrics(summary)
    assert len(metrics["reward_mean"]) == 2 and all(0.0 <= r <= 1.0 for r in metrics["reward_mean"])
    assert 0.0 <= summary["final_eval"]["eval_accuracy"] <= 1.0


def test_chat_recipe_is_graded_by_the_judge_with_constraints(harness, home):
    summary = grpo(build_config("chat", TINY + ["eval_size=2", "max_tokens=12"]))
    metrics = _metrics(summary)
    assert len(metrics["reward_mean"]) == 2 and all(0.0 <= r <= 1.0 for r in metrics["reward_mean"])
    assert 0.0 <= summary["final_eval"]["eval_reward_mean"] <= 1.0
    # The checkable part of the reward is logged on its own, for training samples and held out.
    assert len(metrics["instructions_followed"]) == 2 and all(0.0 <= f <= 1.0 for f in metrics["instructions_followed"])
    assert 0.0 <= summary["final_eval"]["eval_instructions_followed"] <= 1.0


def test_dapo_aime_smoke_runs_every_dapo_option(harness, home):
    config = build_config("dapo_aime_cpu", ["iterations=2", "eval_size=2", "max_tokens=16", "overlong_cache=8"])
    assert config.dynamic_sampling and config.loss_fn == "ppo" and config.loss_normalization == "token"
    summary = grpo(config)
    metrics = _metrics(summary)
    assert all(1 <= r <= config.max_sampling_rounds for r in metrics["sampling_rounds"])
    assert all(k <= config.groups_per_batch for k in metrics["groups_kept"])
    assert all(-1.0 <= p <= 0.0 for p in metrics["overlong_penalty_mean"])
    final = summary["final_eval"]
    assert set(final) >= {"eval_avg_at_2", "eval_pass_at_2"} and final["eval_pass_at_2"] >= final["eval_avg_at_2"]
