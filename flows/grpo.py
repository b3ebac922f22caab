"""The GRPO flow: SFT warm start, then N x [sample, score, advantages, train, evaluate].

Every stage is a cached, retried Prefect task whose key hashes its inputs' content, so
rerunning the same config after a crash replays finished stages from the cache and
continues; MLflow is logged here, in the flow, from the values the tasks return.
"""

from __future__ import annotations

import os
import re
import resource
import time
from pathlib import Path
from typing import Any

import psutil
from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flows.allocator import allocator
from flows.config import GRPOConfig
from flows.tracking import Tracker
from mint.checkpoints import failpoint
from mint.grpo import is_constant
from tasks.common import (
    Artifact,
    ArtifactError,
    artifacts_in,
    check_prompts_fit,
    content_key,
    data_dir,
    exclusive,
    intact,
    remove_checkpoint,
    replace_artifact,
)
from tasks.rollouts import compute_advantages, evaluate, keep_mixed_groups, reward_metrics, sample, score
from tasks.train import init_policy, sft_warm_start, train


class StageRunner:
    """Calls tasks: counts which ran and which came back from the cache, times each stage, and
    remakes a bad input.

    Every artifact a task returns is remembered with the call that made it. When a task fails
    and one of its input artifacts is missing or corrupted (deleted by the retention policy, a
    disk fault, a hand edit), that call is rerun with a fresh cache, which rewrites the
    artifact, and then the task is retried. So a bad file is recomputed where it is needed and
    never propagates, and a rerun replaying the cache never needs files it does not read.
    """

    def __init__(self) -> None:
        self.ran = 0
        self.cached = 0
        self.remade = 0
        self.seconds: dict[str, float] = {}
        self._makers: dict[str, tuple] = {}  # artifact path -> (task, args, kwargs) of the call that wrote it

    def __call__(self, task, *args, **kwargs) -> Any:
        failpoint(f"stage:{task.name}")
        start = time.perf_counter()
        result = self._call(task, args, kwargs)
        self.seconds[task.name] = time.perf_counter() - start
        return result

    def fan_out(self, task, runner: str, shards: int, **kwargs) -> list:
        """``task`` on ``shards`` shards (``shard=i, shards=n``) through the named task runner; the
        shards' lists interleaved back into one (shard i holds items i, i+n, ...)."""
        failpoint(f"stage:{task.name}")
        start = time.perf_counter()
        parts = self._call(task, (), kwargs, shards=(runner, shards))
        self.seconds[task.name] = time.perf_counter() - start
        merged = [None] * sum(len(part) for part in parts)
        for i, part in enumerate(parts):
            merged[i::shards] = part
        return merged

    def ensure(self, artifact: Artifact) -> Artifact:
        """``artifact`` if it is intact on disk, else remade by the call that wrote it."""
        return artifact if intact(artifact) else self._remake(artifact)

    def _call(self, task, args: tuple, kwargs: dict, refresh: bool = False, shards: tuple | None = None,
              inputs_remade: bool = False) -> Any:
        runnable = task.with_options(refresh_cache=True) if refresh else task
        bad: list[Artifact] = []
        # Another process computing the same stage (a run of another config sharing the cache) goes
        # first; this one then finds its result in the cache. 256 lock files, not one per call.
        with exclusive(f"stage-{content_key(task.name, {'args': args, **kwargs})[:2]}"):
            try:
                result = self._submit(runnable, args, kwargs, shards) if shards else self._run(runnable, args, kwargs)
            except Exception:
                bad = [a for a in artifacts_in((args, kwargs)) if not intact(a)]
                if not bad or inputs_remade:
                    raise
        if bad:
            for artifact in bad:
                remade = self._remake(artifact)
                args, kwargs = replace_artifact(args, artifact, remade), replace_artifact(kwargs, artifact, remade)
            return self._call(task, args, kwargs, refresh, shards, inputs_remade=True)
        for artifact in artifacts_in(result):
            self._makers[artifact.path] = (task, args, kwargs)
        return result

    def _remake(self, artifact: Artifact) -> Artifact:
        if artifact.path not in self._makers:
            raise ArtifactError(f"artifact {artifact.path} is missing or corrupted, and no stage of this run "
                                "made it, so it cannot be remade")
        task, args, kwargs = self._makers[artifact.path]
        get_run_logger().warning("%s is missing or corrupted: rerunning %s to remake it", artifact.path, task.name)
        self.remade += 1
        result = self._call(task, args, kwargs, refresh=True)
        return next(a for a in artifacts_in(result) if a.path == artifact.path)

    def _run(self, task, args: tuple, kwargs: dict) -> Any:
        state = task(*args, return_state=True, **kwargs)
        result = state.result()
        self._count(state)  # after the result: an attempt that failed on a bad input is not counted
        return result

    def _submit(self, task, args: tuple, kwargs: dict, shards: tuple) -> list:
        runner, n = shards
        with task_runner(runner, n) as pool:
            futures = [pool.submit(task, parameters={**kwargs, "shard": i, "shards": n}) for i in range(n)]
            results = [future.result() for future in futures]
            for future in futures:
                self._count(future.state)
            return results

    def _count(self, state) -> None:
        if state.name == "Cached":
            self.cached += 1
        else:
            self.ran += 1


def task_runner(name: str, workers: int):
    """A Prefect task runner by name: ``threads`` (default), ``dask`` (a local cluster) or ``ray``."""
    if name == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    if name == "dask":
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                              "dashboard_address": None})
    if name == "ray":
        from prefect_ray import RayTaskRunner

        return RayTaskRunner(init_kwargs={"num_cpus": workers, "include_dashboard": False})
    raise ValueError(f"task_runner: unknown runner {name!r}; expected threads, dask or ray")


@flow(name="grpo")
def grpo(config: GRPOConfig) -> dict:
    logger = get_run_logger()
    # A second run of the same config waits for the first, then replays its results from the cache:
    # two writers would log every MLflow step twice.
    with exclusive(f"run-{config.run_key()}", on_wait=lambda: logger.warning(
            "another run of this config (%s) is in progress: waiting for it to finish", config.run_key())):
        return _grpo(config, logger)


def _grpo(config: GRPOConfig, logger) -> dict:
    run = StageRunner()
    gauge = ProcessGauge(reset_peaks=os.environ.get("MINTFLOW_ITERATION_PEAKS") == "1")
    check_prompts_fit(config.base_model, config.dataset, config.eval_dataset, config.eval_size, config.prompt_template,
                      config.max_tokens)
    with Tracker(data_dir(), f"mintflow-{config.recipe}", config.run_key(), f"{config.recipe}-{config.run_key()}",
                 _flat_params(config), flow_run.get_id(), logger) as tracker:
        lora = dict(base_model=config.base_model, rank=config.rank, train_unembed=config.train_unembed)
        evaluate_args = dict(dataset=config.eval_dataset or config.dataset, eval_size=config.eval_size,
                             max_tokens=config.max_tokens, reward=config.reward, reward_options=config.reward_options,
                             prompt_template=config.prompt_template, samples=config.eval_samples,
                             temperature=config.temperature, seed=config.seed, **_sampler_args(config))

        policy = run(init_policy, seed=config.seed, **lora)
        history: list[dict] = []
        first = {"iteration": 0}
        retention = Retention(config.keep_checkpoints)
        if config.sft:
            retention.add(policy, None)
            policy, sft_metrics = run(sft_warm_start, policy, dataset=config.sft.dataset, steps=config.sft.steps,
                                      batch_size=config.sft.batch_size, learning_rate=config.sft.learning_rate,
                                      seed=config.seed, **lora)
            first.update(sft_metrics)
        first.update(run(evaluate, policy, **evaluate_args))
        tracker.log_step(0, _numbers(first))
        history.append(first)
        retention.add(policy, first["eval_accuracy"])
        logger.info("iteration 0: held-out accuracy %.2f (memory allocator: %s)", first["eval_accuracy"], allocator())

        with _progress() as bar:
            job = bar.add_task("GRPO", total=config.iterations, reward="-", accuracy=f"{first['eval_accuracy']:.2f}")
            for iteration in range(1, config.iterations + 1):
                started = time.perf_counter()
                run.seconds.clear()
                gauge.start_iteration()
                rollouts, rewards, sample_metrics, sampled = sample_and_score(run, config, policy, iteration)
                batch, batch_metrics = run(compute_advantages, rollouts, rewards, base_model=config.base_model,
                                           kl_penalty_coef=config.kl_penalty_coef,
                                           remove_constant_reward_groups=config.remove_constant_reward_groups,
                                           max_tokens=config.max_tokens, overlong_cache=config.overlong_cache,
                                           overlong_penalty_factor=config.overlong_penalty_factor,
                                           loss_normalization=config.loss_normalization)
                batch_metrics.update(sample_metrics.pop("sampled_reward_metrics", {}))
                policy, train_metrics = run(train, policy, batch, loss_fn=config.loss_fn,
                                            loss_fn_config=config.loss_fn_config, learning_rate=config.learning_rate,
                                            grad_clip_norm=config.grad_clip_norm, iteration=iteration, **lora)
                record = {"iteration": iteration, **sample_metrics, **batch_metrics, **train_metrics}
                if _eval_due(config, iteration):
                    record.update(run(evaluate, policy, **evaluate_args))
                record.update({f"stage_seconds_{name}": s for name, s in run.seconds.items()})
                record.update(gauge.read())
                tracker.log_step(iteration, _numbers(record))
                failpoint("flow:iteration_logged")
                if _eval_due(config, iteration) and not tracker.checkpoint_logged(iteration):
                    if Path(policy.path).exists():
                        policy = run.ensure(policy)  # a corrupted one is remade, never uploaded
                        tracker.log_checkpoint(iteration, policy.path)
                    else:  # a replay into a new MLflow run does not remake what retention deleted
                        logger.warning("iteration %d: checkpoint %s was deleted (keep_checkpoints=%d); "
                                       "not logged to MLflow", iteration, policy.path, config.keep_checkpoints)
                retention.add(policy, record.get("eval_accuracy"), in_use=tracker.uploading(),
                              made_from=[*sampled, rollouts, batch])
                record["iteration_seconds"] = time.perf_counter() - started  # all of it: tasks, Prefect, MLflow
                history.append(record)
                accuracy = f"{record['eval_accuracy']:.2f}" if "eval_accuracy" in record else None
                bar.update(job, advance=1, reward=f"{record['reward_mean']:.2f}",
                           **({"accuracy": accuracy} if accuracy else {}))

        tracker.log_curves(history)
        policy = run.ensure(policy)
        version = tracker.register_adapter(f"mintflow-{config.recipe}", policy.path)

    rows = [{"iteration": h["iteration"], "mean_reward": round(h["reward_mean"], 3) if "reward_mean" in h else None,
             "eval_accuracy": round(h["eval_accuracy"], 3) if "eval_accuracy" in h else None,
             "seconds": round(h.get("iteration_seconds", 0.0), 3), "peak_rss_mb": round(h.get("peak_rss_mb", 0.0)),
             "iteration_peak_rss_mb": round(h["iteration_peak_rss_mb"]) if "iteration_peak_rss_mb" in h else None,
             "rss_mb": round(h.get("rss_mb", 0.0)),
             **{k: round(h[k], 3) for k in ("instructions_followed", "eval_instructions_followed") if k in h},
             "stage_seconds": {k.removeprefix("stage_seconds_"): round(v, 3) for k, v in h.items()
                               if k.startswith("stage_seconds_")}} for h in history]
    create_table_artifact([{k: r[k] for k in ("iteration", "mean_reward", "eval_accuracy", "seconds")} for r in rows],
                          key=re.sub(r"[^a-z0-9-]", "-", f"grpo-{config.recipe}".lower()),
                          description=f"GRPO {config.recipe}, run {config.run_key()}")
    final_eval = next(h for h in reversed(history) if "eval_accuracy" in h)
    return {"flow_run_id": flow_run.get_id(), "mlflow_run_id": tracker.run_id, "mlflow_tracking_uri": tracker.uri,
            "registered_model": f"mintflow-{config.recipe}", "registered_version": version,
            "final_checkpoint": policy.path, "final_checkpoint_digest": policy.digest,
            "final_eval": {k: v for k, v in final_eval.items() if k.startswith("eval_")},
            "history": rows, "tasks_ran": run.ran, "tasks_cached": run.cached, "artifacts_remade": run.remade}


class ProcessGauge:
    """What this process holds, per iteration: resident memory now, its peak over the whole
    run, open file descriptors and child processes; with ``reset_peaks``, also its peak within
    the iteration.

    ``reset_peaks`` resets the kernel's high-water mark at the start of every iteration
    (``clear_refs``), so a peak that creeps up shows as a trend in ``iteration_peak_rss_mb``
    rather than hiding in a running maximum; ``peak_rss_mb`` still keeps the run's maximum. It
    is off unless asked for (``MINTFLOW_ITERATION_PEAKS=1``; the benchmarks ask), because the
    reset also hides the true peak from outside tools such as ``/usr/bin/time``.
    """

    def __init__(self, reset_peaks: bool = False) -> None:
        self.process = psutil.Process()
        self.run_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.resets = reset_peaks

    def start_iteration(self) -> None:
        self.run_peak_mb = max(self.run_peak_mb, self._high_water_mb())
        if not self.resets:
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size
        except OSError:  # not Linux, or not allowed: the peak is then the run's only
            self.resets = False

    def read(self) -> dict[str, float]:
        peak = self._high_water_mb()
        self.run_peak_mb = max(self.run_peak_mb, peak)
        numbers = {"rss_mb": self.process.memory_info().rss / 2**20, "peak_rss_mb": self.run_peak_mb,
                   "open_files": self.process.num_fds(), "child_processes": len(self.process.children(recursive=True))}
        if self.resets:
            numbers["iteration_peak_rss_mb"] = peak
        return numbers

    @staticmethod
    def _high_water_mb() -> float:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 1024


def sample_and_score(run: StageRunner, config: GRPOConfig, policy, iteration: int) -> tuple[Any, list, dict, list]:
    """Sample a batch of groups and score them. With dynamic sampling (DAPO), keep sampling new
    problems until ``groups_per_batch`` groups have mixed rewards or ``max_sampling_rounds`` ran,
    and keep only those groups. Also returns every rollout file sampled."""
    rounds, round_rewards, metrics = [], [], {}
    for sampling_round in range(config.max_sampling_rounds if config.dynamic_sampling else 1):
        rollouts, round_metrics = run(sample, policy, dataset=config.dataset, groups_per_batch=config.groups_per_batch,
                                      group_size=config.group_size, max_tokens=config.max_tokens,
                                      temperature=config.temperature, seed=config.seed, iteration=iteration,
                                      prompt_template=config.prompt_template, sampling_round=sampling_round,
                                      **_sampler_args(config))
        rewards = run.fan_out(score, config.task_runner, config.score_shards, rollouts=rollouts,
                              reward=config.reward, reward_options=config.reward_options)
        rounds.append(rollouts)
        round_rewards.append(rewards)
        for name, value in round_metrics.items():
            metrics[name] = metrics.get(name, 0.0) + value
        if sum(not is_constant(r) for rs in round_rewards for r in rs) >= config.groups_per_batch:
            break
    metrics["sample_tokens_per_s"] = metrics["sampled_tokens"] / max(metrics["sample_seconds"], 1e-9)
    if not config.dynamic_sampling:
        return rounds[0], round_rewards[0], metrics, rounds
    rollouts, rewards, kept = run(keep_mixed_groups, rounds, round_rewards, groups_per_batch=config.groups_per_batch)
    # The reward curve stays the one of what was sampled, not of the groups kept.
    metrics["sampled_reward_metrics"] = reward_metrics([r for rs in round_rewards for r in rs])
    return rollouts, rewards, {**metrics, **kept}, rounds


class Retention:
    """Keeps the last ``keep_last`` policy checkpoints and the best evaluated one, deleting the rest
    with the rollout and batch files that made them (0 = keep all). A deleted file that a later
    stage needs is remade by ``StageRunner``."""

    def __init__(self, keep_last: int) -> None:
        self.keep_last = keep_last
        self.policies: list[tuple[Artifact, float | None, list[Artifact]]] = []
        self.deleted: set[str] = set()

    def add(self, policy: Artifact, eval_accuracy: float | None, in_use: set[str] = frozenset(),
            made_from: list[Artifact] = ()) -> list[Artifact]:
        """Record the newest policy and the files it was trained from; delete the checkpoints no
        longer kept (but not those ``in_use``) and their files, and return those checkpoints."""
        self.policies.append((policy, eval_accuracy, list(made_from)))
        if not self.keep_last:
            return []
        keep = {p.path for p, _, _ in self.policies[-self.keep_last:]}
        evaluated = [(accuracy, i) for i, (_, accuracy, _) in enumerate(self.policies) if accuracy is not None]
        if evaluated:
            keep.add(self.policies[max(evaluated)[1]][0].path)  # the best; the latest of equals
        old = [(p, files) for p, _, files in self.policies
               if p.path not in keep | in_use and p.path not in self.deleted]
        for artifact, files in old:
            remove_checkpoint(artifact)
            for file in files:
                Path(file.path).unlink(missing_ok=True)
            self.deleted.add(artifact.path)
        return [artifact for artifact, _ in old]


def _sampler_args(config: GRPOConfig) -> dict:
    return {"sampler": config.sampler, "gpu_memory_utilization": config.gpu_memory_utilization}


def _eval_due(config: GRPOConfig, iteration: int) -> bool:
    return iteration == config.iterations or (config.eval_every > 0 and iteration % config.eval_every == 0)


def _numbers(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"}


def _flat_params(config: GRPOConfig) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.model_dump().items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("reward {task.fields[reward]}  eval acc {task.fields[accuracy]}"), TimeElapsedColumn(),
                    console=Console(stderr=True))  # stdout stays clean for --json
