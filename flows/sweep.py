"""Sweeps: one base recipe, a grid or random search over config fields, compared in MLflow.

    mintflow sweep sweeps/lr_group.yaml

Each point is a child GRPO run: a deployment run on the worker when ``mintflow serve`` is
up (``grpo/<recipe>``), else a subflow in this process. The sweep has its own MLflow run
with every point's run nested under it; at the end it logs a comparison table (also a
Prefect table artifact), an overlay plot of the held-out accuracy and reward curves, and
tags the best point by the chosen metric. A point whose MLflow run already finished is
reused as it is, so rerunning a grown sweep runs only the new points.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SWEEP_TAG = "mintflow.sweep"


class RandomSearch(BaseModel):
    """``samples`` points drawn with ``seed``: a list is a choice, ``{low, high, log}`` a number range."""

    model_config = ConfigDict(extra="forbid")
    samples: int = Field(ge=1, le=1000)
    seed: int = 0
    space: dict[str, list[Any] | dict[str, float | bool]]

    @field_validator("space")
    @classmethod
    def _ranges(cls, space: dict) -> dict:
        for name, dim in space.items():
            if isinstance(dim, dict):
                if set(dim) - {"low", "high", "log", "integer"} or not {"low", "high"} <= set(dim):
                    raise ValueError(f"random.space.{name}: expected {{low, high, log?, integer?}} or a list")
                if dim["low"] > dim["high"] or (dim.get("log") and dim["low"] <= 0):
                    raise ValueError(f"random.space.{name}: need 0 < low <= high for log, low <= high otherwise")
            elif not dim:
                raise ValueError(f"random.space.{name}: empty list of choices")
        return space


class SweepSpec(BaseModel):
    """A sweep file: the base recipe, fixed overrides, and the search."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Sweep name (MLflow experiment mintflow-sweep-NAME)")
    recipe: str = Field(description="Base recipe, by name or path")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Fixed config fields for every point")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="Cartesian product of these values")
    random: RandomSearch | None = None
    metric: str = Field("eval_accuracy", description="Final metric that picks the best point")
    mode: Literal["max", "min"] = "max"
    parallelism: int = Field(1, ge=1, le=64, description="Points running at once (deployment runs only)")

    @model_validator(mode="after")
    def _one_search(self) -> SweepSpec:
        if bool(self.grid) == bool(self.random):
            raise ValueError("give exactly one of grid or random")
        for name, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{name}: empty list of values")
        return self


def load_sweep(path: str | Path) -> SweepSpec:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"sweep: file {path} not found")
    return SweepSpec.model_validate(yaml.safe_load(path.read_text()) or {})


def points(spec: SweepSpec) -> list[dict[str, Any]]:
    """The overrides of every point, in a fixed order (grid: row-major; random: seeded draws)."""
    if spec.grid:
        names = list(spec.grid)
        return [dict(zip(names, values)) for values in itertools.product(*(spec.grid[n] for n in names))]
    rng = random.Random(spec.random.seed)
    drawn = []
    for _ in range(spec.random.samples):
        point = {}
        for name, dim in spec.random.space.items():
            if isinstance(dim, list):
                point[name] = rng.choice(dim)
            else:
                if dim.get("log"):
                    value = math.exp(rng.uniform(math.log(dim["low"]), math.log(dim["high"])))
                else:
                    value = rng.uniform(dim["low"], dim["high"])
                point[name] = round(value) if dim.get("integer") else float(f"{value:.4g}")
        drawn.append(point)
    return drawn


def point_configs(spec: SweepSpec) -> list[tuple[dict[str, Any], Any]]:
    """(point, validated GRPOConfig) for every point; a bad point fails the whole sweep before any run."""
    from flows.config import build_config

    out = []
    for i, point in enumerate(points(spec)):
        settings = {**spec.overrides, **point}
        try:
            config = build_config(spec.recipe, [f"{k}={json.dumps(v)}" for k, v in settings.items()])
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"sweep point {i} {point}: {e}") from e
        out.append((point, config))
    return out


def sweep_key(spec: SweepSpec) -> str:
    """Names the sweep's parent run: the same sweep grown by new points continues it."""
    return hashlib.sha256(json.dumps([spec.name, spec.recipe]).encode()).hexdigest()[:16]


def table_rows(results: list[dict], metric: str) -> list[dict]:
    """The comparison table: one row per point, its overrides, final metrics, and which is best."""
    return [{**r["point"], metric: r["final"].get(metric), "final_reward_mean": r["final"].get("reward_mean"),
             "mlflow_run_id": r["run_id"], "best": r.get("best", False)} for r in results]


def pick_best(results: list[dict], metric: str, mode: str) -> dict:
    scored = [r for r in results if r["final"].get(metric) is not None]
    if not scored:
        raise ValueError(f"metric: no point logged {metric!r}; logged: {sorted(results[0]['final'])}")
    return (max if mode == "max" else min)(scored, key=lambda r: r["final"][metric])


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", text.lower())


def _run_points(todo: list[tuple[dict, Any]], parallelism: int) -> None:
    """Run the points not finished yet: as deployment runs when the servers are up, else as subflows here."""
    import concurrent.futures
    import os

    from prefect import get_run_logger

    logger = get_run_logger()
    deployment = _deployment_for(todo[0][1].recipe) if todo and os.environ.get("PREFECT_API_URL") else None
    if deployment is None:
        from flows.grpo import grpo

        if parallelism > 1:
            logger.info("parallelism %d needs the servers (mintflow serve); running the points one by one here",
                        parallelism)
        for point, config in todo:
            logger.info("point %s: running in this process", point)
            grpo(config)
        return

    from prefect.deployments import run_deployment

    def run(point, config):
        logger.info("point %s: running as a run of deployment %s", point, deployment)
        flow_run = run_deployment(name=deployment, parameters={"config": config.model_dump()}, timeout=None)
        if not flow_run.state or not flow_run.state.is_completed():
            raise RuntimeError(f"sweep point {point}: flow run {flow_run.name} ended "
                               f"{flow_run.state.name if flow_run.state else 'without a state'}: "
                               f"{flow_run.state.message if flow_run.state else ''}")

    with concurrent.futures.ThreadPoolExecutor(parallelism) as pool:
        for future in [pool.submit(run, point, config) for point, config in todo]:
            future.result()


def _deployment_for(recipe: str) -> str | None:
    """``grpo/<recipe>`` if the Prefect API has that deployment."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(f"grpo/{recipe}")
        except ObjectNotFound:
            return None
    return f"grpo/{recipe}"


@flow(name="sweep")
def sweep(spec: SweepSpec) -> dict:
    """Run every point of the sweep (reusing finished ones), then compare them in MLflow and Prefect."""
    from prefect import get_run_logger
    from prefect.artifacts import create_table_artifact

    from flows.tracking import SweepTracker
    from tasks.common import data_dir

    logger = get_run_logger()
    configs = point_configs(spec)
    experiment = f"mintflow-{configs[0][1].recipe}"
    with SweepTracker(data_dir(), experiment, spec.name, sweep_key(spec), spec.model_dump()) as tracker:
        todo = [(point, config) for point, config in configs if not tracker.finished(config.run_key())]
        logger.info("sweep %s: %d points, %d finished already, %d to run", spec.name, len(configs),
                    len(configs) - len(todo), len(todo))
        _run_points(todo, spec.parallelism)
        results = [tracker.adopt(point, config.run_key()) for point, config in configs]
        best = pick_best(results, spec.metric, spec.mode)
        best["best"] = True
        rows = table_rows(results, spec.metric)
        tracker.log_comparison(rows, results, best, spec.metric)
    create_table_artifact(rows, key=slug(f"sweep-{spec.name}"),
                          description=f"Sweep {spec.name}: {len(rows)} points, best by {spec.metric} ({spec.mode})")
    return {"sweep": spec.name, "mlflow_run_id": tracker.run_id, "rows": rows,
            "best": {"point": best["point"], "run_id": best["run_id"], spec.metric: best["final"][spec.metric]},
            "ran": len(todo), "reused": len(configs) - len(todo)}
