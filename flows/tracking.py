"""MLflow tracking for a GRPO run: the one place that talks to MLflow.

One MLflow run per config (tagged with its run key): a rerun of the same config,
after a crash or not, continues that run, and a step already logged is never
logged twice. Metrics use ``step=iteration``; checkpoints are logged as artifacts;
the final adapter is registered as a model version with an alias.

A tracking server that goes down mid-run does not stop training, nor slow it: what the run
logs meanwhile is kept in order, the server is tried again at most every
``RETRY_WHILE_DOWN_S``, and everything is delivered when it answers. At the end
the run waits for it at most ``$MINTFLOW_MLFLOW_WAIT_S`` seconds (default 600), then
fails naming the server; a rerun of the same config delivers the missing steps (its
stages all come from the cache). A server that is down when the run starts fails it
at once, before any work.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlflow
import requests
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from mint.checkpoints import failpoint
from tasks.common import exclusive

REGISTERED_ALIAS = "champion"  # "latest" is reserved by MLflow


def tracking_uri(data_dir: Path) -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else a SQLite store in the data dir."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{data_dir / 'mlflow.db'}"


def _experiment_id(client: MlflowClient, name: str, data_dir: Path) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    artifacts = os.environ.get("MINTFLOW_ARTIFACT_ROOT")
    if not artifacts and not client.tracking_uri.startswith(("http:", "https:")):  # a server picks its own store
        artifacts = (data_dir / "mlartifacts").absolute().as_uri()
    return client.create_experiment(name, artifact_location=artifacts)


def _open_client(uri: str) -> MlflowClient:
    """An MLflow client. A fresh SQLite store is created (its tables migrated) by the first client
    that opens it, in its constructor: two processes at once would both migrate it and one fails
    ("table ... already exists"), so opening is one process at a time."""
    with exclusive("mlflow-store"):
        return MlflowClient(uri)


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking server does not answer."""


def _unreachable(exc: BaseException) -> bool:
    """Whether an MLflow call failed because the server is down or failing (not because the call was wrong)."""
    if isinstance(exc, (requests.exceptions.RequestException, ConnectionError)):
        return True
    text = str(exc)
    return isinstance(exc, mlflow.exceptions.MlflowException) and (
        "failed with exception" in text or "failed with error code 5" in text)


RETRY_WHILE_DOWN_S = 30.0  # while the server is down, calls made during training try it at most this often


class Tracker:
    def __init__(self, data_dir: Path, experiment: str, run_key: str, run_name: str, params: dict,
                 flow_run_id: str | None, logger: logging.Logger | None = None):
        # An unreachable server fails each call in seconds (MLflow's default retries take minutes);
        # the calls are then kept and retried here.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        self.uri = tracking_uri(data_dir)
        self.client = _open_client(self.uri)
        self.logger = logger or logging.getLogger(__name__)
        self.wait_s = float(os.environ.get("MINTFLOW_MLFLOW_WAIT_S", "600"))
        self._pending: list[Callable[[], object]] = []
        self._down_since: float | None = None
        self._last_failure = 0.0
        try:
            with exclusive("mlflow-store"):  # see _open_client: the experiment is created once too
                self._open(data_dir, experiment, run_key, run_name, params, flow_run_id)
        except Exception as exc:
            if _unreachable(exc):
                raise TrackingUnavailable(f"the MLflow tracking server {self.uri} does not answer ({exc}); start it, "
                                          "or unset MLFLOW_TRACKING_URI to track in the local store") from None
            raise

    def _open(self, data_dir: Path, experiment: str, run_key: str, run_name: str, params: dict,
              flow_run_id: str | None) -> None:
        experiment_id = _experiment_id(self.client, experiment, data_dir)
        runs = self.client.search_runs([experiment_id], f"tags.`mintflow.run_key` = '{run_key}'", max_results=1)
        if runs:
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=run_name, tags={"mintflow.run_key": run_key})
            self.run_id = run.info.run_id
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        if flow_run_id:
            self.client.set_tag(self.run_id, "prefect.flow_run_id", flow_run_id)
        self._logged = {m.step for m in self.client.get_metric_history(self.run_id, "iteration_done")}
        # A checkpoint counts as logged once its upload finished (then ``checkpoint_logged`` is written):
        # one cut off mid-upload is uploaded again, whole.
        self._checkpoints = {m.step for m in self.client.get_metric_history(self.run_id, "checkpoint_logged")}

    def _deliver(self, call: Callable[[], object]) -> None:
        """Make an MLflow call now, or, while the server is down, keep it (in order) for later."""
        self._pending.append(call)
        if self._down_since is not None and time.monotonic() - self._last_failure < RETRY_WHILE_DOWN_S:
            return  # it failed moments ago, and each try costs seconds: train on, try again later
        self.flush(wait_s=0)

    def flush(self, wait_s: float) -> None:
        """Deliver the kept calls, retrying with backoff for up to ``wait_s`` seconds."""
        deadline = time.monotonic() + wait_s
        delay = 1.0
        while self._pending:
            try:
                self._pending[0]()
            except Exception as exc:
                if not _unreachable(exc):
                    raise
                self._last_failure = time.monotonic()
                if self._down_since is None:
                    self._down_since = self._last_failure
                    self.logger.warning("MLflow server %s does not answer (%s); training goes on and what it logs "
                                        "is kept until the server is back", self.uri, str(exc)[:200])
                if time.monotonic() >= deadline:
                    if wait_s:
                        raise TrackingUnavailable(
                            f"the MLflow tracking server {self.uri} did not come back within {wait_s:.0f} s; "
                            f"{len(self._pending)} calls are not delivered. Nothing is lost: start the server and "
                            "rerun the same config (its stages come from the cache and the missing steps are "
                            "logged)") from None
                    return
                time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
                delay = min(2 * delay, 30.0)
                continue
            self._pending.pop(0)
        if self._down_since is not None:
            self.logger.warning("MLflow server %s is back after %.0f s; the kept calls are delivered", self.uri,
                                time.monotonic() - self._down_since)
            self._down_since = None

    def uploading(self) -> set[str]:
        """Folders whose upload waits for the server: they must stay on disk until it is back."""
        return {call.args[1] for call in self._pending
                if isinstance(call, partial) and call.func == self._upload_checkpoint}

    def _until_delivered(self, call: Callable[[], object]):
        """Deliver everything kept, then make this call, waiting for the server if it is down."""
        result = []
        self._pending.append(lambda: result.append(call()))
        self.flush(self.wait_s)
        return result[0]

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """Log one iteration's metrics once; ``iteration_done`` is written last and marks the step complete."""
        if step in self._logged:
            return
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()] + [Metric("iteration_done", 1, now, step)]
        for start in range(0, len(batch), 900):
            self._deliver(partial(self.client.log_batch, self.run_id, metrics=batch[start:start + 900]))
        self._logged.add(step)

    def checkpoint_logged(self, step: int) -> bool:
        return step in self._checkpoints

    def log_checkpoint(self, step: int, path: str) -> None:
        if step not in self._checkpoints:
            self._deliver(partial(self._upload_checkpoint, step, path))
            self._checkpoints.add(step)

    def _upload_checkpoint(self, step: int, path: str) -> None:
        self.client.log_artifacts(self.run_id, path, f"checkpoints/iter-{step:05d}")
        failpoint("tracking:checkpoint_uploaded")  # uploaded, not yet marked
        self.client.log_metric(self.run_id, "checkpoint_logged", 1, step=step)

    def log_curves(self, history: list[dict]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        steps = [h["iteration"] for h in history if "reward_mean" in h]
        ax.plot(steps, [h["reward_mean"] for h in history if "reward_mean" in h], label="mean sampled reward")
        evals = [h for h in history if "eval_accuracy" in h]
        ax.plot([h["iteration"] for h in evals], [h["eval_accuracy"] for h in evals], "o-",
                label="held-out accuracy")
        for key, style, label in (("instructions_followed", "-", "instructions followed (sampled)"),
                                  ("eval_instructions_followed", "o--", "instructions followed (held out)")):
            points = [h for h in history if key in h]  # a judge reward's checkable part, when prompts have one
            if points:
                ax.plot([h["iteration"] for h in points], [h[key] for h in points], style, label=label)
        ax.set_xlabel("iteration")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
        self._until_delivered(partial(self.client.log_figure, self.run_id, fig, "reward_curve.png"))
        plt.close(fig)

    def register_adapter(self, model_name: str, path: str) -> str:
        """Log the final adapter and register it as a model version with the alias ``champion``."""
        return self._until_delivered(partial(self._register_adapter, model_name, path))

    def _register_adapter(self, model_name: str, path: str) -> str:
        self.client.log_artifacts(self.run_id, path, "final_adapter")
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/final_adapter"
        try:
            self.client.get_registered_model(model_name)
        except mlflow.exceptions.MlflowException:
            self.client.create_registered_model(model_name)
        for version in self.client.search_model_versions(f"name = '{model_name}'"):
            if version.run_id == self.run_id and version.source == source:
                break
        else:
            version = self.client.create_model_version(model_name, source, run_id=self.run_id)
        self.client.set_registered_model_alias(model_name, REGISTERED_ALIAS, version.version)
        self.client.set_tag(self.run_id, "mintflow.registered_model", f"{model_name}/{version.version}")
        return str(version.version)

    def finish(self, status: str = "FINISHED") -> None:
        self._until_delivered(partial(self.client.set_terminated, self.run_id, status=status))

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # FAILED on any error (a rerun of the same config sets it RUNNING again and continues).
        if exc_type is None:
            self.finish("FINISHED")
            return
        try:
            self.wait_s = min(self.wait_s, 10.0)  # the run failed already: do not hold its error for long
            self.finish("FAILED")
        except TrackingUnavailable as unavailable:
            self.logger.warning("%s", unavailable)


class SweepTracker:
    """A sweep's parent MLflow run, in the experiment of its points, which become its nested runs."""

    def __init__(self, data_dir: Path, experiment: str, name: str, sweep_key: str, spec: dict):
        self.uri = tracking_uri(data_dir)
        self.client = _open_client(self.uri)
        with exclusive("mlflow-store"):  # see _open_client: the experiment is created once too
            self.experiment_id = _experiment_id(self.client, experiment, data_dir)
        runs = self.client.search_runs([self.experiment_id], f"tags.`mintflow.sweep` = '{sweep_key}'", max_results=1)
        if runs:
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(self.experiment_id, run_name=f"sweep-{name}",
                                                 tags={"mintflow.sweep": sweep_key}).info.run_id
        self.client.set_tag(self.run_id, "mintflow.sweep_spec", json.dumps(spec, default=str)[:5000])  # may grow

    def _point_run(self, run_key: str):
        runs = self.client.search_runs([self.experiment_id], f"tags.`mintflow.run_key` = '{run_key}'", max_results=1)
        return runs[0] if runs else None

    def finished(self, run_key: str) -> bool:
        """Whether the point with this run key has a FINISHED MLflow run (so it is reused, not rerun)."""
        run = self._point_run(run_key)
        return run is not None and run.info.status == "FINISHED"

    def adopt(self, point: dict, run_key: str) -> dict:
        """Nest a point's run under the sweep; return its final metrics and curves."""
        run = self._point_run(run_key)
        if run is None or run.info.status != "FINISHED":
            raise RuntimeError(f"sweep point {point}: no finished MLflow run with run key {run_key}")
        self.client.set_tag(run.info.run_id, "mlflow.parentRunId", self.run_id)
        self.client.set_tag(run.info.run_id, "mintflow.sweep_point", json.dumps(point))
        curves = {name: [(m.step, m.value) for m in sorted(self.client.get_metric_history(run.info.run_id, name),
                                                           key=lambda m: m.step)]
                  for name in ("eval_accuracy", "reward_mean")}
        return {"point": point, "run_id": run.info.run_id, "final": dict(run.data.metrics), "curves": curves}

    def log_comparison(self, rows: list[dict], results: list[dict], best: dict, metric: str) -> None:
        """The comparison table, the overlay plot, and the best point's tags."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        columns = list(rows[0])
        self.client.log_table(self.run_id, {c: [json.dumps(r[c]) if isinstance(r[c], (dict, list)) else r[c]
                                                for r in rows] for c in columns}, "comparison.json")
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
        for result in results:
            label = ", ".join(f"{k}={v}" for k, v in result["point"].items()) + (" (best)" if result is best else "")
            style = {"linewidth": 2.5} if result is best else {"alpha": 0.8}
            for ax, name in ((top, "eval_accuracy"), (bottom, "reward_mean")):
                steps = result["curves"][name]
                ax.plot([s for s, _ in steps], [v for _, v in steps], "o-" if ax is top else "-", label=label, **style)
        top.set_ylabel("held-out accuracy")
        bottom.set_ylabel("mean sampled reward")
        bottom.set_xlabel("iteration")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend(fontsize=8)
        self.client.log_figure(self.run_id, fig, "sweep_curves.png")
        plt.close(fig)
        for result in results:
            self.client.set_tag(result["run_id"], "mintflow.sweep_best", str(result is best).lower())
        self.client.set_tag(self.run_id, "mintflow.best_run_id", best["run_id"])
        self.client.set_tag(self.run_id, "mintflow.best_point", json.dumps(best["point"]))
        self.client.log_metric(self.run_id, f"best_{metric}", float(best["final"][metric]))

    def __enter__(self) -> SweepTracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if exc_type is None else "FAILED")


def download_registered_adapter(model_name: str, alias: str = REGISTERED_ALIAS, uri: str | None = None,
                                dst_path: str | Path | None = None) -> str:
    """A local folder with the registered adapter, ready for ``create_sampling_client(model_path=...)``.

    It is downloaded under ``dst_path``, or else under a new temporary folder that the caller removes.
    """
    client = MlflowClient(uri)
    version = client.get_model_version_by_alias(model_name, alias)
    target = str(dst_path) if dst_path is not None else tempfile.mkdtemp(prefix="mintflow-adapter-")
    Path(target).mkdir(parents=True, exist_ok=True)
    return mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=target, tracking_uri=uri)


__all__ = ["SweepTracker", "Tracker", "download_registered_adapter", "tracking_uri", "RunTag"]
