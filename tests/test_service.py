"""Service mode for real: `mintflow serve` starts a Prefect server, a process worker and an MLflow
server on free loopback ports; `mintflow deploy` creates the deployments; a run triggered the way
the UI triggers it executes on the worker and lands in the MLflow server."""

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

pytestmark = pytest.mark.service

BIN = Path(sys.executable).parent
TINY = {"iterations": 1, "eval_every": 0, "eval_size": 4, "groups_per_batch": 2, "group_size": 2, "max_tokens": 4,
        "sft": None}


def _clean_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "MINTFLOW_HOME"))}
    return {**env, "MINTFLOW_HOME": str(home)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("served")
    process = subprocess.Popen([str(BIN / "mintflow"), "serve", "--home", str(home), "--prefect-port",
                                str(free_port()), "--mlflow-port", str(free_port())],
                               env=_clean_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not (home / "servers.json").is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"mintflow serve did not come up:\n{process.stdout.read()}")
        time.sleep(0.5)
    info = json.loads((home / "servers.json").read_text())
    yield {"home": home, "process": process, **info}
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        process.wait(90)


@pytest.fixture(scope="module")
def deployed(served):
    out = subprocess.run([str(BIN / "mintflow"), "deploy", "--home", str(served["home"])],
                         env=_clean_env(served["home"]), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "deployed grpo/math" in out.stdout
    return served


def _prefect_settings(served):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: served["prefect_url"]})


def test_serve_starts_both_servers_and_a_limited_process_pool(served):
    import urllib.request

    for url in (f"{served['prefect_url']}/health", f"{served['mlflow_url']}/health"):
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
    from prefect.client.orchestration import get_client

    with _prefect_settings(served), get_client(sync_client=True) as client:
        deadline = time.monotonic() + 60
        while (pool := client.read_work_pool("mintflow")).status != "READY" and time.monotonic() < deadline:
            time.sleep(1)  # READY once the worker's first heartbeat arrives
        assert pool.type == "process" and pool.concurrency_limit == 1 and pool.status == "READY"
    assert (served["home"] / "mlflow" / "mlflow.db").is_file() and (served["home"] / "prefect").is_dir()


def test_deployments_carry_the_recipe_the_typed_form_and_a_nightly_schedule(deployed):
    from prefect.client.orchestration import get_client

    with _prefect_settings(deployed), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("grpo/math")
        assert deployment.work_pool_name == "mintflow"
        assert deployment.parameters["config"]["recipe"] == "math"
        assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"] and deployment.schedules[0].active
        schema = json.dumps(deployment.parameter_openapi_schema)
        assert "Samples per prompt" in schema and '"minimum": 2' in schema  # descriptions and bounds in the form


def test_the_api_refuses_a_run_with_a_field_out_of_bounds(deployed):
    import httpx
    from prefect.client.orchestration import get_client

    with _prefect_settings(deployed), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("grpo/math")
        bad = {**deployment.parameters["config"], "group_size": 1}
        with pytest.raises(httpx.HTTPStatusError) as refused:
            client.create_flow_run_from_deployment(deployment.id, parameters={"config": bad})
        assert "group_size" in refused.value.response.text, refused.value.response.text


def test_a_ui_triggered_run_completes_on_the_worker_and_lands_in_mlflow(deployed):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    with _prefect_settings(deployed):
        with get_client(sync_client=True) as client:
            config = {**client.read_deployment_by_name("grpo/math").parameters["config"], **TINY}
        flow_run = run_deployment("grpo/math", parameters={"config": config}, timeout=600)
    assert flow_run.state.is_completed(), f"{flow_run.state.name}: {flow_run.state.message}"
    runs = MlflowClient(deployed["mlflow_url"]).search_runs(
        [MlflowClient(deployed["mlflow_url"]).get_experiment_by_name("mintflow-math").experiment_id],
        f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["iteration_done"] == 1 and "eval_accuracy" in runs[0].data.metrics


def test_a_sweep_runs_its_points_as_deployment_runs_when_the_servers_are_up(deployed, tmp_path):
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(json.dumps({"name": "served", "recipe": "math", "overrides": TINY,
                                      "grid": {"learning_rate": [2e-4, 3e-4]}}))  # not the run above
    out = subprocess.run([str(BIN / "mintflow"), "sweep", str(sweep_file), "--home", str(deployed["home"]), "--json"],
                         env=_clean_env(deployed["home"]), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout[out.stdout.index("{"):])
    assert (summary["ran"], summary["reused"]) == (2, 0) and len(summary["rows"]) == 2
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    client = MlflowClient(deployed["mlflow_url"])  # the points ran on the worker and logged to the server
    children = [client.get_run(row["mlflow_run_id"]) for row in summary["rows"]]
    assert all(child.data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"] for child in children)
    with _prefect_settings(deployed), get_client(sync_client=True) as prefect:
        runs = prefect.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["math"])))
    assert {child.data.tags["prefect.flow_run_id"] for child in children} <= {str(r.id) for r in runs}
    deployed["sweep"] = summary


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium is not installed: `make setup` tries `apt-get install chromium`, which failed here")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def screenshots(served):
    folder = Path(os.environ.get("MINTFLOW_SCREENSHOTS") or served["home"] / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _open_run_form(deployed, browser):
    """The Prefect UI's custom-run page of grpo/math, once its config form has rendered."""
    from prefect.client.orchestration import get_client

    with _prefect_settings(deployed), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("grpo/math")
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    page.goto(f"{deployed['prefect_url'].removesuffix('/api')}/deployments/deployment/{deployment.id}/run")
    page.get_by_text("Samples per prompt", exact=False).first.wait_for(timeout=90_000)
    return page


def test_the_prefect_ui_shows_the_deployments_typed_run_form(deployed, browser, screenshots):
    page = _open_run_form(deployed, browser)
    page.screenshot(path=str(screenshots / "prefect-run-form.png"), full_page=True)
    text = page.inner_text("body")
    assert "Custom" in text or "Run" in text
    for description in ("Samples per prompt", "Adam learning rate", "LoRA rank"):  # the config's own field docs
        assert description in text, description
    page.close()


def test_the_prefect_ui_form_refuses_an_out_of_bounds_value_naming_the_field(deployed, browser, screenshots):
    page = _open_run_form(deployed, browser)
    group_size = page.locator(".schema-form-property", has=page.get_by_text("Samples per prompt")).last
    group_size.locator("input[type=number]").fill("1")
    page.get_by_role("button", name="Submit").click()
    refusal = page.get_by_text("Validation failed for field 'config.group_size'", exact=False).first
    refusal.wait_for(timeout=30_000)
    page.screenshot(path=str(screenshots / "prefect-run-form-refused.png"), full_page=True)
    assert "less than the minimum of 2" in refusal.inner_text()
    page.close()
    from prefect.client.orchestration import get_client

    with _prefect_settings(deployed), get_client(sync_client=True) as client:
        assert all(run.parameters.get("config", {}).get("group_size") != 1 for run in client.read_flow_runs())


def test_the_mlflow_ui_compares_the_sweeps_runs(deployed, browser, screenshots):
    assert "sweep" in deployed, "needs the sweep test above to have run"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(deployed["mlflow_url"])
    experiment = client.get_experiment_by_name("mintflow-math").experiment_id
    run_ids = [row["mlflow_run_id"] for row in deployed["sweep"]["rows"]]
    names = [client.get_run(r).info.run_name for r in run_ids]
    page = browser.new_page(viewport={"width": 1400, "height": 1400})
    page.goto(f"{deployed['mlflow_url']}/#/compare-runs?runs={json.dumps(run_ids)}&experiments={json.dumps([experiment])}")
    page.get_by_text(names[0], exact=False).first.wait_for(timeout=90_000)
    page.screenshot(path=str(screenshots / "mlflow-sweep-compare.png"), full_page=True)
    text = page.inner_text("body")
    assert all(name in text for name in names) and "eval_accuracy" in text and "learning_rate" in text
    page.close()


def _mlflow_steps(client, experiment: str, flow_run_id) -> tuple[object, list[int]]:
    """The MLflow run of a flow run (None until it exists) and the steps its ``iteration_done`` has, in order."""
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'") if found else []
    if not runs:
        return None, []
    return runs[0], sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "iteration_done"))


def _until(what: str, check, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(1)
    return result


def _flow_run_state(served, flow_run_id):
    """The flow run's state, or None while the Prefect API does not answer."""
    import httpx
    from prefect.client.orchestration import get_client

    try:
        with _prefect_settings(served), get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id).state
    except (httpx.HTTPError, OSError):
        return None


def test_a_run_survives_a_kill_9_of_the_prefect_server_and_of_the_mlflow_server(deployed):
    # Before the supervisor, a Prefect server killed mid-run made `mintflow serve` stop the worker
    # with the run in it: the run was left Running in the Prefect database, and its MLflow run RUNNING.
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    home, iterations = deployed["home"], 6
    before = json.loads((home / "servers.json").read_text())["pids"]
    with _prefect_settings(deployed):
        with get_client(sync_client=True) as client:
            config = {**client.read_deployment_by_name("grpo/math").parameters["config"], **TINY,
                      "iterations": iterations, "eval_every": 1}
        # _sync: the browser fixture's event loop would make it return a coroutine
        flow_run = run_deployment("grpo/math", parameters={"config": config}, timeout=0, _sync=True)
    mlflow = MlflowClient(deployed["mlflow_url"])

    def steps() -> list[int]:
        return _mlflow_steps(mlflow, "mintflow-math", flow_run.id)[1]

    def ended():
        state = _flow_run_state(deployed, flow_run.id)
        return state if state is not None and state.is_final() else None

    _until("iteration 1 in MLflow", lambda: 1 in steps())
    os.killpg(before[0], signal.SIGKILL)  # the Prefect server and its uvicorn, as an OOM kill would
    at_prefect_kill = steps()[-1]
    assert at_prefect_kill < iterations, "the run ended before the Prefect server was killed: make it longer"
    _until("the Prefect server restarted", lambda: json.loads((home / "servers.json").read_text())["pids"][0]
           != before[0] and _flow_run_state(deployed, flow_run.id) is not None, timeout=180)
    _until("an iteration logged after the Prefect restart", lambda: steps()[-1] > at_prefect_kill)
    assert (running := _flow_run_state(deployed, flow_run.id)).is_running(), running
    os.killpg(before[1], signal.SIGKILL)  # the MLflow server, mid-run too
    state = _until("the flow run to end", ended)
    assert state.is_completed(), f"{state.name}: {state.message}"

    run, logged = _mlflow_steps(mlflow, "mintflow-math", flow_run.id)
    assert run.info.status == "FINISHED" and logged == list(range(iterations + 1))  # each step exactly once
    after = json.loads((home / "servers.json").read_text())["pids"]
    assert after[0] != before[0] and after[1] != before[1] and after[2] == before[2]  # the worker rode it out
    log = (home / "logs" / "serve.log").read_text()
    for name, pid in (("prefect-server", before[0]), ("mlflow-server", before[1])):
        assert f"{name} (pid {pid}) exited with code -9; restarted it" in log, log
    with _prefect_settings(deployed), get_client(sync_client=True) as client:
        runs = [r for r in client.read_flow_runs() if r.parameters.get("config") == config]
    assert [r.id for r in runs] == [flow_run.id]  # no second run of it was created
    assert deployed["process"].poll() is None  # `mintflow serve` is still up


def test_a_process_that_keeps_dying_stops_everything_with_a_clear_message(tmp_path, monkeypatch):
    from flows import serve as service

    started = []

    def launch(servers, name):  # the servers stay up; the worker dies at once, every time
        started.append(subprocess.Popen(["true"] if name == "prefect-worker" else ["sleep", "600"],
                                        start_new_session=True))
        return started[-1]

    def start(home, *ports):
        (home / "logs").mkdir()
        servers = service.Servers(home, "http://127.0.0.1:1/api", "http://127.0.0.1:2")
        servers.processes = [launch(servers, name) for name in service.NAMES]
        return servers

    monkeypatch.setattr(service, "_launch", launch)
    monkeypatch.setattr(service, "start", start)
    monkeypatch.setattr(service, "RESTARTS", 2)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # pytest keeps its own Ctrl-C
    with pytest.raises(SystemExit) as stopped:
        service.serve(tmp_path, 1, 2)
    assert stopped.value.code == 1
    log = (tmp_path / "logs" / "serve.log").read_text()
    assert log.count("prefect-worker (pid") == 3 and log.count("restarted it as pid") == 2, log
    assert "exited with code 0, 3 times in 600 s (at most 2 restarts): stopping everything" in log, log
    assert all(process.poll() is not None for process in started) and not (tmp_path / "servers.json").exists()


def test_ctrl_c_stops_every_server_process(served):
    # Runs last in this module (pytest keeps file order): the fixture's finalizer then has nothing to do.
    process = served["process"]
    pids = set(served["pids"]) | set(json.loads((served["home"] / "servers.json").read_text())["pids"])  # restarted
    process.send_signal(signal.SIGINT)
    assert process.wait(90) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (served["home"] / "servers.json").exists()
