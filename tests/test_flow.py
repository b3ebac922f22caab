"""The GRPO flow on a tiny config: stages in order, caching, MLflow content, retries, kill and resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port
from mlflow.tracking import MlflowClient

import rewards
from flows.config import GRPOConfig, build_config
from flows.tracking import download_registered_adapter, tracking_uri
from mint.checkpoints import read_manifest
from tasks.common import data_dir

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[1]
TINY = ["iterations=2", "groups_per_batch=2", "group_size=2", "max_tokens=4", "eval_size=4", "eval_every=0",
        "sft.steps=1", "sft.batch_size=2"]
STAGES = ["init_policy", "sft_warm_start", "evaluate"] + ["sample", "score", "compute_advantages", "train"] * 2 + [
    "evaluate"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MINTFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "home"


def tiny(*extra) -> GRPOConfig:
    return build_config("math", TINY + list(extra))


def task_run_names(flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [r.name.rsplit("-", 1)[0]
            for r in sorted(runs, key=lambda r: r.start_time or r.expected_start_time)]


def test_stages_run_in_order_then_a_rerun_is_fully_cached_and_tracked_once(harness, home):
    from flows.grpo import grpo

    config = tiny("seed=11")
    first = grpo(config)
    assert first["tasks_ran"] == len(STAGES) and first["tasks_cached"] == 0
    assert task_run_names(first["flow_run_id"]) == STAGES
    second = grpo(config)
    assert second["tasks_ran"] == 0 and second["tasks_cached"] == len(STAGES)
    assert second["final_checkpoint_digest"] == first["final_checkpoint_digest"]
    assert second["mlflow_run_id"] == first["mlflow_run_id"]

    client = MlflowClient(first["mlflow_tracking_uri"])
    run = client.get_run(first["mlflow_run_id"])
    assert run.data.params["learning_rate"] == "0.0001" and run.data.params["sft.steps"] == "1"
    assert run.data.tags["prefect.flow_run_id"] == second["flow_run_id"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_accuracy")] == [0, 2]
    for key in ("frac_mixed", "frac_all_good", "frac_all_bad", "kl_sample_train", "entropy", "loss",
                "train_tokens_per_s", "stage_seconds_sample", "reward_std", "rss_mb", "peak_rss_mb"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 2, key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"reward_curve.png", "final_adapter", "checkpoints"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == ["checkpoints/iter-00002"]

    import mint
    from mint import types

    adapter = download_registered_adapter("mintflow-math", uri=first["mlflow_tracking_uri"], dst_path=home / "adapter")
    sampler = mint.ServiceClient(checkpoint_dir=home / "x").create_sampling_client(model_path=adapter)
    out = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences[0].tokens) <= 2


def test_a_flaky_reward_is_retried(harness, home, monkeypatch):
    from flows.grpo import grpo

    calls = {"n": 0}

    def flaky(completion, example, **options):
        calls["n"] += 1
        if calls["n"] == 1:
            raise TimeoutError("judge timed out")
        return rewards.math_reward(completion, example)

    monkeypatch.setitem(rewards.REWARDS, "flaky", flaky)
    summary = grpo(tiny("reward=flaky", "iterations=1", "seed=12"))
    assert summary["tasks_ran"] > 0 and calls["n"] > 4  # the first score attempt failed, the retry scored all


def test_a_reward_that_keeps_failing_stops_the_run_naming_the_sample(harness, home, monkeypatch):
    from flows.grpo import grpo

    def broken(completion, example, **options):
        raise ValueError("cannot parse")

    monkeypatch.setitem(rewards.REWARDS, "broken", broken)
    monkeypatch.setattr("tasks.rollouts.score.retry_delay_seconds", [0, 0, 0])
    monkeypatch.setattr("tasks.rollouts.evaluate.retry_delay_seconds", [0, 0, 0])
    config = tiny("reward=broken", "iterations=1", "seed=13")
    with pytest.raises(Exception, match=r"reward 'broken' failed on (eval problem|group) 0.* \(problem 'add-"):
        grpo(config)
    client = MlflowClient(tracking_uri(data_dir()))
    experiment = client.get_experiment_by_name("mintflow-math").experiment_id
    [run] = client.search_runs([experiment], f"tags.`mintflow.run_key` = '{config.run_key()}'")
    assert run.info.status == "FAILED"
    checkpoints = list((home / "checkpoints").iterdir())
    assert len(checkpoints) == 2 and all((c / "manifest.json").is_file() for c in checkpoints)  # init + sft kept


def test_a_problem_too_long_for_the_context_stops_the_run_before_anything_is_written(harness, home, tmp_path):
    from flows.grpo import grpo

    problems = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    problems.insert(7, {"question": "word " * 9000, "answer": "1"})
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    with pytest.raises(ValueError, match=r"^dataset: 1 of 19 problems are too long .*problem 'long-8'"):
        grpo(tiny(f"dataset={path}", "seed=14"))
    assert not (home / "checkpoints").exists() and not (home / "mlflow.db").exists()


def _policies(home: Path) -> list[Path]:
    return sorted(p for p in (home / "checkpoints").iterdir() if not p.name.startswith("."))


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupted_or_deleted_artifact_is_remade_where_it_is_needed_and_the_result_is_unchanged(harness, home):
    from flows.grpo import grpo

    config = tiny("seed=14")
    first = grpo(config)
    final = Path(first["final_checkpoint"])
    rollouts = sorted((home / "rollouts").glob("*.json"), key=lambda p: p.stat().st_mtime)
    datums = sorted((home / "datums").glob("*.json"), key=lambda p: p.stat().st_mtime)
    # The final checkpoint and iteration 2's batch and rollouts are corrupted, iteration 1's policy is gone:
    # remaking the final policy needs all of them, in a chain.
    _corrupt(final / "adapter_model.safetensors")
    _corrupt(datums[-1])
    _corrupt(rollouts[-1])
    shutil.rmtree(_policy_after(home, iteration=1))

    second = grpo(config)
    assert second["final_checkpoint_digest"] == first["final_checkpoint_digest"]
    assert second["artifacts_remade"] == 4
    assert second["tasks_ran"] == 4  # train 1, sample 2, compute_advantages 2, train 2; nothing else
    assert [h["mean_reward"] for h in second["history"]] == [h["mean_reward"] for h in first["history"]]
    for path in (final, datums[-1], rollouts[-1]):
        assert path.exists()
    read_manifest(final)
    client = MlflowClient(second["mlflow_tracking_uri"])
    assert sorted(m.step for m in client.get_metric_history(second["mlflow_run_id"], "iteration_done")) == [0, 1, 2]


def test_retention_keeps_the_last_checkpoints_and_the_best_and_a_rerun_never_needs_the_deleted_ones(harness, home):
    from flows.grpo import grpo

    first = grpo(tiny("seed=15", "iterations=3", "eval_every=1", "keep_checkpoints=1"))
    accuracy = {h["iteration"]: h["eval_accuracy"] for h in first["history"]}
    best = max(accuracy, key=lambda i: (accuracy[i], i))
    kept = _policies(home)
    assert Path(first["final_checkpoint"]) in kept
    assert len(kept) == (1 if best == 3 else 2)  # init, SFT and the other iterations' policies are deleted
    for path in kept:
        read_manifest(path)
    assert not [p for p in (home / "checkpoints").iterdir() if p.name.startswith(".")]  # nothing half deleted
    for kind in ("rollouts", "datums"):  # the files of deleted policies went with them: 3 made, 1 or 2 kept
        assert len(list((home / kind).glob("*.json"))) <= len(kept) < 3

    again = grpo(tiny("seed=15", "iterations=3", "eval_every=1", "keep_checkpoints=1"))
    assert again["tasks_ran"] == 0 and again["artifacts_remade"] == 0
    longer = grpo(tiny("seed=15", "iterations=4", "eval_every=1", "keep_checkpoints=1"))
    assert longer["artifacts_remade"] == 0
    assert longer["tasks_ran"] == 5  # iteration 4's sample, score, advantages, train, evaluate


def _policy_after(home: Path, iteration: int) -> Path:
    """The checkpoint folder of the policy after GRPO ``iteration`` (TINY has one SFT step before)."""

    [found] = [p for p in _policies(home) if read_manifest(p, verify=False)["step"] == 1 + iteration]
    return found


@pytest.mark.parametrize("override, field", [
    ("group_size=1", "group_size"), ("max_tokens=1000000000", "max_tokens"), ("learning_rate=-1", "learning_rate"),
    ("bogus=1", "bogus"), ("loss_fn=grpo", "loss_fn"), ("sft.steps=0", "sft.steps"), ("reward=nope", "reward"),
    ("loss_fn_config={clip: 1}", "loss_fn_config"),
])
def test_bad_config_values_are_refused_before_any_work_naming_the_field(override, field, tmp_path):
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "math", "--set", override], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "MINTFLOW_HOME": str(tmp_path)})
    assert out.returncode != 0 and field in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()


@pytest.fixture(scope="module")
def prefect_api(harness) -> str:
    """The module's Prefect server for CLI runs. Without one, each CLI starts its own for ~5 s."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _cli(home: Path, *extra, fault: str | None = None, env_overrides: dict | None = None,
         prefect_api: str | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "flows.cli", "run", "math", "--json"]
    for item in TINY + ["seed=21", *extra]:
        args += ["--set", item]
    # Its own home for everything, MLflow included (the session's store would merge runs of one config).
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MINTFLOW_FAULT", "MLFLOW_TRACKING_URI")}
    env.update({"MINTFLOW_HOME": str(home), "PREFECT_HOME": str(home / "prefect"),
                "PREFECT_LOCAL_STORAGE_PATH": str(home / "prefect" / "storage"), **(env_overrides or {})})
    if fault:
        env["MINTFLOW_FAULT"] = fault
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "stderr.log", "a")  # noqa: SIM115 - closed with the process
    # Its own session: a kill takes the whole group, the CLI's ephemeral Prefect server included, as a crash would.
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)


def _summary(proc: subprocess.Popen, home: Path) -> dict:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, (home / "stderr.log").read_text()[-3000:]
    return json.loads(out[out.index("{"):])


def _kill_group(proc: subprocess.Popen) -> None:
    """What a crash of the machine's process would also take: the CLI's ephemeral Prefect server."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny CLI run, uninterrupted."""
    home = tmp_path_factory.mktemp("reference")
    return {**_summary(_cli(home), home), "log": (home / "stderr.log").read_text()}


def test_the_command_runs_under_jemalloc_where_it_is_installed(reference, monkeypatch):
    import ctypes.util

    from flows.allocator import jemalloc_env

    if not ctypes.util.find_library("jemalloc"):
        pytest.skip("libjemalloc2 is not installed here (make setup installs it): the command keeps glibc's malloc")
    assert "memory allocator: jemalloc" in reference["log"]
    monkeypatch.setenv("MINTFLOW_ALLOCATOR", "glibc")
    assert jemalloc_env() == {}


def _assert_same_result_and_clean_history(resumed: dict, reference: dict, home: Path) -> None:
    assert resumed["final_checkpoint_digest"] == reference["final_checkpoint_digest"]
    assert resumed["final_eval"]["eval_accuracy"] == reference["final_eval"]["eval_accuracy"]
    assert [h["mean_reward"] for h in resumed["history"]] == [h["mean_reward"] for h in reference["history"]]
    client = MlflowClient(resumed["mlflow_tracking_uri"])
    for metric, steps in (("reward_mean", [1, 2]), ("iteration_done", [0, 1, 2]),
                          ("checkpoint_logged", [2])):  # every step once, none twice
        assert sorted(m.step for m in client.get_metric_history(resumed["mlflow_run_id"], metric)) == steps
    for folder in (home / "checkpoints").iterdir():  # every checkpoint in place is complete and verified
        if not folder.name.startswith("."):
            read_manifest(folder)


# Fault points (``MINTFLOW_FAULT``) in the order a fresh run reaches them: at every stage boundary
# (``stage:*``) and inside every stage, checkpoint write and MLflow logging.
CRASHES = ["checkpoint:before_rename",  # inside init_policy's checkpoint write, before its rename
           "stage:sft_warm_start", "sft_warm_start:stepped",
           "stage:evaluate", "evaluate:scoring",
           "stage:sample", "sample:sampled",
           "stage:score", "score:scoring",
           "stage:compute_advantages", "compute_advantages:computed",
           "stage:train", "train:stepped", "checkpoint:before_rename", "train:checkpoint_written",
           "flow:iteration_logged",  # the iteration's metrics are in MLflow, the flow has not gone on
           "tracking:checkpoint_uploaded"]  # the final checkpoint is uploaded, not yet marked as logged


def test_a_crash_anywhere_then_a_rerun_gives_the_uninterrupted_result(reference, prefect_api, tmp_path):
    """One home crashed at each point in turn: every rerun resumes and dies at the next point, the
    last one finishes. Each point is reached in work not yet done, so each is a real crash there."""
    home = tmp_path / "crashed"
    for fault in CRASHES:
        crashed = _cli(home, fault=fault, prefect_api=prefect_api)
        crashed.wait(timeout=600)
        _kill_group(crashed)  # before reading: its orphaned server would hold the output pipe open
        crashed.communicate()
        assert crashed.returncode == -signal.SIGKILL, (fault, (home / "stderr.log").read_text()[-3000:])
        for folder in _policies(home):  # no checkpoint in place is ever half written
            read_manifest(folder)
    _assert_same_result_and_clean_history(_summary(_cli(home, prefect_api=prefect_api), home), reference, home)


def test_kill_9_mid_run_then_rerun_matches_an_uninterrupted_run(reference, tmp_path):
    home = tmp_path / "killed"
    proc = _cli(home)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once the SFT checkpoint and the first train checkpoint exist
        if (home / "checkpoints").is_dir() and len([p for p in (home / "checkpoints").iterdir()
                                                      if not p.name.startswith(".")]) >= 3:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    resumed = _summary(_cli(home), home)
    assert resumed["tasks_cached"] >= 4 and resumed["tasks_ran"] < len(STAGES)
    _assert_same_result_and_clean_history(resumed, reference, home)


def test_runs_at_once_sharing_one_home_wait_or_reuse_and_never_cross_talk(reference, prefect_api, tmp_path):
    """Two runs of one config and a run of another config, started together on one cache and MLflow store."""
    home = tmp_path / "shared"
    same = [_cli(home, prefect_api=prefect_api), _cli(home, prefect_api=prefect_api)]
    other = _cli(home, "learning_rate=0.0002", prefect_api=prefect_api)
    first, second = (_summary(proc, home) for proc in same)
    different = _summary(other, home)

    for summary in (first, second):  # the same result as alone; the waiting one replayed the other's
        assert summary["final_checkpoint_digest"] == reference["final_checkpoint_digest"]
    assert sorted([first["tasks_ran"], second["tasks_ran"]])[0] == 0
    assert first["mlflow_run_id"] == second["mlflow_run_id"] != different["mlflow_run_id"]
    assert "waiting for it to finish" in (home / "stderr.log").read_text()
    # Until the first train step (its learning rate differs) the two configs' stages are the same ones:
    # init_policy, sft_warm_start, evaluate, and iteration 1's sample, score and advantages, computed once.
    assert first["tasks_ran"] + second["tasks_ran"] + different["tasks_ran"] == 2 * len(STAGES) - 6
    client = MlflowClient(first["mlflow_tracking_uri"])
    for run_id in (first["mlflow_run_id"], different["mlflow_run_id"]):
        assert sorted(m.step for m in client.get_metric_history(run_id, "iteration_done")) == [0, 1, 2]
    assert different["final_checkpoint_digest"] != reference["final_checkpoint_digest"]

    for folder in _policies(home):
        read_manifest(folder)


def _wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


class MlflowServer:
    """A real MLflow tracking server on 127.0.0.1 that a test can kill -9 and start again on the same store."""

    def __init__(self, home: Path) -> None:
        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        from flows.serve import spawn_mlflow_server, wait_healthy

        self.process = spawn_mlflow_server(self.home, self.port)
        wait_healthy(f"{self.url}/health", self.process, "MLflow server", self.home / "logs" / "mlflow-server.log")

    def kill(self) -> None:
        _kill_group(self.process)
        self.process.wait()

    def logged_steps(self) -> list[int]:
        client = MlflowClient(self.url)
        experiment = client.get_experiment_by_name("mintflow-math")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        return sorted(m.step for r in runs for m in client.get_metric_history(r.info.run_id, "iteration_done"))


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path / "mlflow-server")
    server.start()
    yield server
    server.kill()


def _assert_tracked_once(summary: dict, iterations: int) -> None:
    client = MlflowClient(summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "iteration_done")) == list(
        range(iterations + 1))
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")] == [
        f"checkpoints/iter-{i:05d}" for i in range(1, iterations + 1)]
    assert client.get_model_version_by_alias("mintflow-math", "champion").run_id == run.info.run_id


def test_an_mlflow_server_down_mid_run_does_not_stop_training_and_gets_everything_when_back(mlflow_server, tmp_path):
    home = tmp_path / "run"
    run = _cli(home, "iterations=4", "eval_every=1", env_overrides={"MLFLOW_TRACKING_URI": mlflow_server.url})
    _wait_for(lambda: 1 in mlflow_server.logged_steps(), "iteration 1 in MLflow")
    mlflow_server.kill()
    trained = len(_policies(home))
    _wait_for(lambda: "does not answer" in (home / "stderr.log").read_text() and len(_policies(home)) > trained,
              "a train step while MLflow is down")
    mlflow_server.start()
    summary = _summary(run, home)
    _assert_tracked_once(summary, 4)
    assert "is back after" in (home / "stderr.log").read_text()


def test_while_the_mlflow_server_is_down_training_tries_it_at_most_every_so_often_and_keeps_the_order(
        tmp_path, monkeypatch):
    import flows.tracking
    from flows.tracking import Tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(tmp_path, "mintflow-test", "key", "name", {}, None)
    server_up, attempts, delivered = False, [], []

    def call(name):
        def make():
            attempts.append(name)
            if not server_up:
                raise ConnectionError("connection refused")
            delivered.append(name)
        return make

    tracker._deliver(call("step 1"))
    tracker._deliver(call("step 2"))  # moments after a failure: kept, not tried (each try costs seconds)
    assert attempts == ["step 1"] and len(tracker._pending) == 2
    monkeypatch.setattr(flows.tracking, "RETRY_WHILE_DOWN_S", 0.0)  # as if the interval had passed
    tracker._deliver(call("step 3"))
    assert attempts == ["step 1", "step 1"] and len(tracker._pending) == 3  # the oldest call goes first
    server_up = True
    tracker._deliver(call("step 4"))
    assert delivered == ["step 1", "step 2", "step 3", "step 4"] and not tracker._pending


def test_an_mlflow_server_down_for_good_fails_the_run_in_bounded_time_and_a_rerun_delivers_the_rest(
        mlflow_server, tmp_path):
    home = tmp_path / "run"
    env = {"MLFLOW_TRACKING_URI": mlflow_server.url, "MINTFLOW_MLFLOW_WAIT_S": "5"}
    run = _cli(home, "iterations=3", "eval_every=1", env_overrides=env)
    _wait_for(lambda: 1 in mlflow_server.logged_steps(), "iteration 1 in MLflow")
    mlflow_server.kill()
    run.communicate(timeout=600)
    assert run.returncode != 0
    assert "did not come back within 5 s" in (home / "stderr.log").read_text()
    for folder in _policies(home):  # the run stopped cleanly: every checkpoint is complete
        read_manifest(folder)

    mlflow_server.start()
    rerun = _summary(_cli(home, "iterations=3", "eval_every=1", env_overrides=env), home)
    assert rerun["tasks_ran"] == 0  # everything came from the cache; only the tracking was delivered
    _assert_tracked_once(rerun, 3)


def test_eval_command_scores_a_checkpoint(service, tmp_path):
    path = service.create_lora_training_client("HuggingFaceTB/SmolLM2-135M-Instruct", rank=16, seed=0) \
        .save_state(str(tmp_path / "policy")).result().path
    out = subprocess.run([sys.executable, "-m", "flows.cli", "eval", path, "--recipe", "math", "--set", "eval_size=4",
                          "--set", "max_tokens=8", "--json"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "MINTFLOW_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads(out.stdout)
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["eval_accuracy"] * 4 == int(metrics["eval_accuracy"] * 4)
