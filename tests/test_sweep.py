"""Sweeps: points from a grid or a seeded random search, each a child run, compared in MLflow."""

import json

import pytest
from mlflow.tracking import MlflowClient

from flows.sweep import SweepSpec, load_sweep, point_configs, points, sweep

TINY = {"iterations": 1, "eval_every": 0, "eval_size": 4, "groups_per_batch": 2, "group_size": 2, "max_tokens": 4,
        "sft": None}


def test_a_grid_is_the_product_of_its_values_in_a_fixed_order():
    spec = SweepSpec(name="g", recipe="math", grid={"learning_rate": [1e-4, 2e-4], "group_size": [2, 4]})
    assert points(spec) == [{"learning_rate": 1e-4, "group_size": 2}, {"learning_rate": 1e-4, "group_size": 4},
                            {"learning_rate": 2e-4, "group_size": 2}, {"learning_rate": 2e-4, "group_size": 4}]


def test_random_search_is_seeded_and_stays_in_its_ranges():
    spec = SweepSpec(name="r", recipe="math", random={"samples": 6, "seed": 3, "space": {
        "learning_rate": {"low": 1e-5, "high": 1e-3, "log": True}, "rank": [4, 8, 16],
        "group_size": {"low": 2, "high": 8, "integer": True}}})
    drawn = points(spec)
    assert drawn == points(spec) and len(drawn) == 6
    assert all(1e-5 <= p["learning_rate"] <= 1e-3 and p["rank"] in (4, 8, 16) and 2 <= p["group_size"] <= 8
               and isinstance(p["group_size"], int) for p in drawn)


@pytest.mark.parametrize("bad, message", [
    ({"grid": {}}, "exactly one of grid or random"),
    ({"grid": {"learning_rate": []}}, "grid.learning_rate: empty"),
    ({"grid": {"group_size": [1]}}, "group_size"),             # out of the config's bounds
    ({"grid": {"lerning_rate": [1e-4]}}, "lerning_rate"),      # not a config field
    ({"grid": {"rank": [4]}, "mode": "best"}, "mode"),
])
def test_a_bad_sweep_is_refused_before_any_run_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        point_configs(SweepSpec.model_validate({"name": "bad", "recipe": "math", **bad}))


@pytest.mark.parametrize("path", ["recipes/sweeps/math_lr_group.yaml", "recipes/sweeps/math_lr_group_short.yaml"])
def test_the_example_sweep_files_are_valid(path):
    assert len(point_configs(load_sweep(path))) == 4


@pytest.mark.model
def test_a_sweep_runs_its_points_compares_them_and_reuses_finished_ones(harness):
    spec = SweepSpec(name="tiny", recipe="math", overrides=TINY, grid={"learning_rate": [1e-4, 3e-4]})
    first = sweep(spec)
    assert (first["ran"], first["reused"]) == (2, 0) and len(first["rows"]) == 2
    best = max(first["rows"], key=lambda r: r["eval_accuracy"])
    assert first["best"]["run_id"] == best["mlflow_run_id"] and best["best"]

    client = MlflowClient()
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.data.tags["mintflow.best_run_id"] == best["mlflow_run_id"]
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"comparison.json", "sweep_curves.png"}
    for row in first["rows"]:
        child = client.get_run(row["mlflow_run_id"])
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert json.loads(child.data.tags["mintflow.sweep_point"]) == {"learning_rate": row["learning_rate"]}

    again = sweep(spec)
    assert (again["ran"], again["reused"]) == (0, 2) and again["mlflow_run_id"] == first["mlflow_run_id"]
    grown = sweep(spec.model_copy(update={"grid": {"learning_rate": [1e-4, 3e-4, 2e-4]}}))
    assert (grown["ran"], grown["reused"]) == (1, 2) and grown["mlflow_run_id"] == first["mlflow_run_id"]
