"""What `mintflow deploy` would send, and the Kubernetes job template, checked without a server."""

import copy
import json
from pathlib import Path

import jsonschema
import pytest
from prefect.server.schemas.actions import validate_base_job_template

from flows.config import GRPOConfig
from flows.deploy import deployment_specs

TEMPLATE = Path(__file__).resolve().parents[1] / "deployments" / "kubernetes" / "base-job-template.json"


def test_every_recipe_gets_a_deployment_and_math_runs_nightly():
    specs = {s["name"]: s for s in deployment_specs()}
    assert "math" in specs and specs["math"]["cron"] == "0 3 * * *" and specs["math"]["work_pool"] == "mintflow"
    for spec in specs.values():
        GRPOConfig.model_validate(spec["parameters"]["config"])  # the default parameters are a valid config


def test_the_kubernetes_template_passes_prefects_validation_and_its_form_is_a_json_schema():
    template = json.loads(TEMPLATE.read_text())
    validate_base_job_template(template)
    jsonschema.Draft7Validator.check_schema(template["variables"])
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert {e["name"] for e in container["env"]} >= {"MLFLOW_TRACKING_URI", "MINTFLOW_HOME"}


def test_a_template_using_an_undeclared_variable_is_refused():
    broken = copy.deepcopy(json.loads(TEMPLATE.read_text()))
    del broken["variables"]["properties"]["gpus"]
    with pytest.raises(ValueError, match="gpus"):
        validate_base_job_template(broken)
