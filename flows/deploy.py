"""Create (or update) a Prefect deployment of the GRPO flow for every recipe.

    mintflow deploy [--home DIR] [--recipe math ...]

Each deployment runs ``flows/grpo.py:grpo`` from this checkout on the work pool of
``deployments/deployments.yaml``, with the recipe's config as its default parameters and,
where that file gives one, a cron schedule. Prefect renders the config's JSON schema
(descriptions, defaults, bounds) as the run form, and refuses parameters that break it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENTS = ROOT / "deployments" / "deployments.yaml"
FLOW_ENTRYPOINT = "flows/grpo.py:grpo"


def deployment_specs(recipes: list[str] | None = None) -> list[dict]:
    """Name, parameters and schedule of each deployment (nothing is sent to Prefect here)."""
    from flows.config import RECIPES, build_config

    plan = yaml.safe_load(DEPLOYMENTS.read_text())
    names = recipes or sorted(p.stem for p in RECIPES.glob("*.yaml"))
    unknown = set(plan.get("schedules", {})) - {p.stem for p in RECIPES.glob("*.yaml")}
    if unknown:
        raise ValueError(f"{DEPLOYMENTS.name}: schedules for unknown recipes {sorted(unknown)}")
    specs = []
    for name in names:
        config = build_config(name, [])
        schedule = plan.get("schedules", {}).get(name)
        specs.append({"name": name, "work_pool": plan["work_pool"], "parameters": {"config": config.model_dump()},
                      "cron": schedule["cron"] if schedule else None,
                      "timezone": schedule.get("timezone", "UTC") if schedule else None,
                      "description": f"GRPO on recipe {name!r} ({config.base_model}, reward {config.reward})"})
    return specs


def deploy(recipes: list[str] | None = None) -> list[str]:
    """Send every deployment to the Prefect API in ``PREFECT_API_URL``; returns their ``flow/name`` ids."""
    from prefect import flow
    from prefect.client.schemas.schedules import CronSchedule

    created = []
    for spec in deployment_specs(recipes):
        source = flow.from_source(source=str(ROOT), entrypoint=FLOW_ENTRYPOINT)
        schedules = [CronSchedule(cron=spec["cron"], timezone=spec["timezone"])] if spec["cron"] else None
        source.deploy(name=spec["name"], work_pool_name=spec["work_pool"], parameters=spec["parameters"],
                      schedules=schedules, description=spec["description"], tags=["mintflow", spec["name"]],
                      build=False, push=False, print_next_steps=False)
        created.append(f"grpo/{spec['name']}")
    return created
