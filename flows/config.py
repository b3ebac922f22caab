"""The GRPO run's typed config. Prefect renders it as the run form; every field says what it is and its bounds."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


class SFTConfig(BaseModel):
    """Supervised warm start before RL (the seed's recommended two-stage path)."""

    model_config = ConfigDict(extra="forbid")
    dataset: str = Field("arithmetic", description="Demonstrations: 'arithmetic', 'gsm8k', 'math' or a .jsonl path")
    steps: int = Field(4, ge=1, le=100_000, description="SFT optimizer steps")
    batch_size: int = Field(8, ge=1, le=4096, description="Demonstrations per SFT step")
    learning_rate: float = Field(1e-4, gt=0, le=1e-2, description="Adam learning rate for SFT")


class GRPOConfig(BaseModel):
    """GRPO on a verifiable reward. Defaults are the seed's parameter table."""

    model_config = ConfigDict(extra="forbid")
    recipe: str = Field("custom", description="Name of the recipe this config came from (for tracking)")
    base_model: str = Field("Qwen/Qwen3-0.6B", description="Hub id, local folder, .gguf file, or 'embedded'")
    dataset: str = Field("arithmetic", description="'arithmetic' or 'python_functions' (generated), 'gsm8k', "
                                                   "'math' or a .jsonl path")
    eval_dataset: str | None = Field(None, description="Held-out problems from another dataset (e.g. humaneval); "
                                                       "default: the training dataset's held-out split")
    reward: str = Field("math", description="Reward function, a name in the rewards/ registry (e.g. 'math')")
    reward_options: dict[str, bool | int | float | str] = Field(
        default_factory=dict, description="Keyword options of the reward, e.g. format_bonus, all_or_nothing")
    loss_fn: Literal["importance_sampling", "ppo", "cispo", "dro"] = Field(
        "importance_sampling", description="RL loss; GRPO's default is importance_sampling")
    loss_fn_config: dict[str, float] = Field(default_factory=dict,
                                             description="Loss options (e.g. ppo clip thresholds)")
    group_size: int = Field(4, ge=2, le=64, description="Samples per prompt (typically 4-16)")
    groups_per_batch: int = Field(8, ge=1, le=1024, description="Prompts per training step")
    max_tokens: int = Field(16, ge=1, le=8192, description="Max generated tokens (math ~16, chat ~128, code ~256)")
    learning_rate: float = Field(2e-5, gt=0, le=1e-2, description="Adam learning rate (RL: typically 1e-5 to 4e-5)")
    grad_clip_norm: float = Field(1.0, ge=0, le=1e6, description="Gradient norm clip (0 = off)")
    temperature: float = Field(0.8, gt=0, le=2.0, description="Sampling temperature (typically 0.7-1.0)")
    kl_penalty_coef: float = Field(0.0, ge=0, le=10.0, description="KL penalty to the base model (0 = off)")
    rank: int = Field(16, ge=1, le=512, description="LoRA rank")
    train_unembed: bool = Field(False, description="Also put LoRA on the unembedding (lm_head)")
    iterations: int = Field(20, ge=1, le=1_000_000, description="GRPO iterations")
    eval_every: int = Field(5, ge=0, le=1_000_000, description="Evaluate every N iterations (0 = only at the end)")
    eval_size: int = Field(50, ge=1, le=10_000, description="Held-out problems per evaluation")
    keep_checkpoints: int = Field(0, ge=0, le=1_000_000, description="Keep the last N policy checkpoints and the "
                                  "best evaluated one on disk, deleting older ones (0 = keep all)")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Base seed; every stage derives its own")
    remove_constant_reward_groups: bool = Field(False, description="Drop groups whose rewards are all equal")
    sft: SFTConfig | None = Field(None, description="Optional SFT warm start before RL")
    prompt_template: str = Field("{question}", description="How a problem becomes the user message; "
                                                           "'{question}' is replaced by the problem")
    eval_samples: int = Field(1, ge=1, le=256, description="k samples per held-out problem: 1 = greedy accuracy; "
                                                           "k > 1 = avg@k and pass@k at the sampling temperature")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal and sample "
                                                      "more prompts until the batch is full")
    max_sampling_rounds: int = Field(3, ge=1, le=100, description="Dynamic sampling: at most this many sampling "
                                                                  "rounds per iteration (the cap)")
    loss_normalization: Literal["sum", "token", "sequence"] = Field(
        "sum", description="Advantages summed over tokens (sum), averaged over the batch's tokens (token, DAPO) "
                           "or per reply (sequence, GRPO)")
    overlong_cache: int = Field(0, ge=0, le=8192, description="DAPO overlong shaping: L_cache tokens before "
                                                              "L_max = max_tokens where the penalty ramps (0 = off)")
    overlong_penalty_factor: float = Field(1.0, ge=0, le=10.0, description="DAPO overlong shaping: the penalty "
                                                                         "at L_max")
    sampler: Literal["transformers", "vllm"] = Field(
        "transformers", description="Sampling backend: the mint engine (any device) or vLLM (CUDA, the vllm extra)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=0.95, description="vLLM: share of GPU memory it may take "
                                                                         "(the rest is for training)")
    task_runner: Literal["threads", "dask", "ray"] = Field(
        "threads", description="Where fan-out stages run: Prefect's thread pool, a local Dask cluster "
                               "(prefect-dask) or Ray (prefect-ray); results are the same")
    score_shards: int = Field(1, ge=1, le=256, description="Scoring split into this many parallel tasks "
                                                           "(for slow rewards: judges, sandboxes)")

    @field_validator("task_runner")
    @classmethod
    def _runner_installed(cls, value: str) -> str:
        import importlib.util

        module = {"dask": "prefect_dask", "ray": "prefect_ray"}.get(value)
        if module and importlib.util.find_spec(module) is None:
            raise ValueError(f"task runner {value!r} needs {module.replace('_', '-')}: pip install -e '.[scale]'")
        return value

    @field_validator("sampler")
    @classmethod
    def _sampler_installed(cls, value: str) -> str:
        import importlib.util

        if value == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError("sampler 'vllm' needs vLLM on a CUDA machine: pip install -e '.[vllm]'; "
                             "elsewhere use sampler=transformers")
        return value

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, value: str) -> str:
        from rewards import REWARDS

        if value not in REWARDS:
            raise ValueError(f"unknown reward {value!r}; expected one of {sorted(REWARDS)}")
        return value

    @field_validator("loss_fn_config")
    @classmethod
    def _known_loss_keys(cls, value: dict[str, float], info) -> dict[str, float]:
        from mint.losses import resolve_loss

        resolve_loss(info.data.get("loss_fn", "importance_sampling"), value)
        return value

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, value: str) -> str:
        if "{question}" not in value:
            raise ValueError("prompt_template must contain '{question}' where the problem goes")
        return value

    @field_validator("overlong_cache")
    @classmethod
    def _cache_below_max_tokens(cls, value: int, info) -> int:
        max_tokens = info.data.get("max_tokens")
        if value and max_tokens is not None and value >= max_tokens:
            raise ValueError(f"overlong_cache {value} must be below max_tokens {max_tokens} (L_max)")
        return value

    def run_key(self) -> str:
        """Identifies a run: the same config resumes the same run (and the same MLflow run).
        How stages are spread over workers and how many checkpoints are kept change no result, so
        they are not part of the key."""
        what = self.model_dump(exclude={"task_runner", "score_shards", "keep_checkpoints"})
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def load_recipe(recipe: str) -> dict[str, Any]:
    """A recipe by name (``recipes/<name>.yaml``) or path."""
    path = Path(recipe)
    if not path.suffix:
        path = RECIPES / f"{recipe}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        raise ValueError(f"recipe: {recipe!r} is neither a file nor one of {known}")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"recipe {path}: expected a mapping of config fields")
    values.setdefault("recipe", path.stem)
    return values


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key=value`` pairs (values parsed as YAML, dotted keys reach into nested blocks like sft.steps)."""
    values = json.loads(json.dumps(values))
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        target = values
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[parts[-1]] = yaml.safe_load(raw)
    return values


def build_config(recipe: str, overrides: list[str] | None = None) -> GRPOConfig:
    return GRPOConfig.model_validate(apply_overrides(load_recipe(recipe), overrides or []))
