"""What every task shares: the warm engine, content keys, and atomic artifact files.

Tasks pass each other ``Artifact``s (a path plus the sha256 of its content), never
model objects. A task's cache key hashes its name, its arguments (so an input
artifact counts by its digest, not its path string) and the code version; the folder
or file a task writes is named by that same key, so outputs are content-addressed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from pydantic import BaseModel

import mint
from mint.checkpoints import (
    CheckpointError,
    DiskFullError,
    checkpoint_digest,
    disk_full,
    disk_full_error,
    read_manifest,
    sha256_file,
)

_ROOT = Path(__file__).resolve().parents[1]


def _code_version() -> str:
    digest = hashlib.sha256()
    for package in ("mint", "rewards", "tasks"):
        for file in sorted((_ROOT / package).rglob("*.py")):
            digest.update(file.relative_to(_ROOT).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


CODE_VERSION = _code_version()


class Artifact(BaseModel):
    """A file or checkpoint folder, with the hash of its content."""

    path: str
    digest: str


def data_dir() -> Path:
    """Where runs keep checkpoints, rollouts and the MLflow store (``$MINTFLOW_HOME``, default ./data)."""
    return Path(os.environ.get("MINTFLOW_HOME") or Path.cwd() / "data").absolute()


def content_key(task_name: str, arguments: dict[str, Any]) -> str:
    payload = json.dumps({"task": task_name, "code": CODE_VERSION, "args": arguments}, sort_keys=True,
                         default=lambda o: o.model_dump() if isinstance(o, BaseModel) else str(o))
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def task_cache_key(context, parameters: dict[str, Any]) -> str:
    """Prefect ``cache_key_fn``: the content key of this task call."""
    return f"{context.task.name}-{content_key(context.task.name, parameters)}"


def derived_seed(base_seed: int, *parts: Any) -> int:
    """A seed for one stage of one iteration, so reruns reproduce and stages do not share randomness."""
    digest = hashlib.sha256(json.dumps([base_seed, *parts]).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def write_json(kind: str, key: str, obj: Any) -> Artifact:
    """Write ``obj`` to ``data/<kind>/<key>.json`` atomically (temp file, fsync, rename)."""
    folder = data_dir() / kind
    path = folder / f"{key}.json"
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        if disk_full(e):
            raise disk_full_error(f"artifact {str(path)!r}", folder) from e
        raise
    return Artifact(path=str(path), digest=sha256_file(path))


class ArtifactError(ValueError):
    """An artifact file whose content no longer matches its digest."""


def read_json(artifact: Artifact) -> Any:
    """Read an artifact file, refusing one whose content no longer matches its digest."""
    path = Path(artifact.path)
    if not path.is_file():
        raise FileNotFoundError(f"artifact {path} is missing")
    if sha256_file(path) != artifact.digest:
        raise ArtifactError(f"artifact {path} is corrupted: its sha256 no longer matches")
    return json.loads(path.read_text())


def intact(artifact: Artifact) -> bool:
    """Whether the artifact is on disk with exactly the content it had when written (checkpoints: verified)."""
    path = Path(artifact.path)
    try:
        if path.is_dir():
            read_manifest(path)
            return checkpoint_digest(path) == artifact.digest
        return path.is_file() and sha256_file(path) == artifact.digest
    except CheckpointError:
        return False


def artifacts_in(value: Any) -> list[Artifact]:
    """Every Artifact inside a task's arguments or result (nested in tuples, lists and dicts)."""
    if isinstance(value, Artifact):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for item in value for a in artifacts_in(item)]
    if isinstance(value, dict):
        return [a for item in value.values() for a in artifacts_in(item)]
    return []


def replace_artifact(value: Any, old: Artifact, new: Artifact) -> Any:
    """``value`` with every occurrence of ``old`` replaced by ``new`` (same nesting)."""
    if isinstance(value, Artifact):
        return new if value == old else value
    if isinstance(value, (list, tuple)):
        return type(value)(replace_artifact(item, old, new) for item in value)
    if isinstance(value, dict):
        return {k: replace_artifact(item, old, new) for k, item in value.items()}
    return value


def remove_checkpoint(artifact: Artifact) -> None:
    """Delete a checkpoint folder: renamed away first, so no reader ever sees it half deleted."""
    path = Path(artifact.path)
    if not path.is_dir():
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.deleted-", dir=path.parent))
    try:
        path.rename(trash / "ckpt")
    except FileNotFoundError:  # another run sharing the cache deleted it first
        pass
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def exclusive(name: str, on_wait=None):
    """Hold the lock file ``$MINTFLOW_HOME/locks/<name>.lock`` (released by the kernel if we die).

    ``on_wait`` is called once if another process holds it, before waiting.
    """
    folder = data_dir() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(folder / f"{name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if on_wait:
            on_wait()
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def checkpoint_dir(key: str) -> Path:
    return data_dir() / "checkpoints" / key


def checkpoint_artifact(path: str | Path) -> Artifact:
    return Artifact(path=str(path), digest=checkpoint_digest(path))


# ------------------------------------------------------------------ warm engine
_lock = threading.RLock()
_service: mint.ServiceClient | None = None
_trainers: dict[tuple, mint.TrainingClient] = {}


def service() -> mint.ServiceClient:
    global _service
    with _lock:
        if _service is None:
            _service = mint.ServiceClient(checkpoint_dir=data_dir() / "checkpoints")
        return _service


def sampling_client(policy_path: str, sampler: str = "transformers", gpu_memory_utilization: float = 0.5):
    """A sampling client for the policy checkpoint on the chosen backend (the mint engine, or vLLM)."""
    if sampler == "transformers":
        return service().create_sampling_client(model_path=policy_path)
    from mint.checkpoints import read_manifest
    from mint.models import load_base_model, resolve_weights
    from mint.vllm_sampling import VLLMSamplingClient

    base_model = read_manifest(policy_path)["base_model"]
    base = load_base_model(base_model)  # the tokenizer and stop tokens, shared with training
    return VLLMSamplingClient(resolve_weights(base_model), base.tokenizer, sorted(base.stop_token_ids()),
                              model_path=policy_path, gpu_memory_utilization=gpu_memory_utilization)


_holds: dict[int, str] = {}  # id(training client) -> digest of the checkpoint its state equals


def trainer(base_model: str, rank: int, train_unembed: bool) -> mint.TrainingClient:
    """A warm training client per LoRA shape; tasks load their input checkpoint into it."""
    key = (base_model, rank, train_unembed)
    with _lock:
        if key not in _trainers:
            _trainers[key] = service().create_lora_training_client(base_model, rank=rank, seed=0,
                                                                   train_unembed=train_unembed)
        return _trainers[key]


def resume_from(client: mint.TrainingClient, policy: Artifact) -> None:
    """Put ``policy`` (weights and Adam state) into the warm client.

    Skipped when the client already holds exactly that checkpoint, because it saved it
    in the previous task: the loop then never reads back what it just wrote.
    """
    if _holds.pop(id(client), None) != policy.digest:  # popped: the caller is about to change the state
        client.load_state_with_optimizer(policy.path).result()


def forget(client: mint.TrainingClient) -> None:
    """The client's state is about to change: it no longer equals any saved checkpoint."""
    _holds.pop(id(client), None)


def save_from(client: mint.TrainingClient, key: str) -> Artifact:
    """Save the client's state as the content-addressed checkpoint ``key``, and remember that it holds it."""
    artifact = checkpoint_artifact(client.save_state(str(checkpoint_dir(key))).result().path)
    _holds[id(client)] = artifact.digest
    return artifact


def render_prompt(tokenizer, question: str, template: str = "{question}") -> list[int]:
    """The chat-templated user turn; ``template`` wraps the problem (replace, not format: LaTeX has braces)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": template.replace("{question}", question)}],
                                         add_generation_prompt=True, return_dict=False)


def check_prompts_fit(base_model: str, dataset: str, eval_dataset: str | None, eval_size: int, prompt_template: str,
                      max_tokens: int) -> None:
    """Refuse, before a run starts, training or held-out problems whose prompt leaves fewer than
    ``max_tokens`` of the model's context. The engine refuses them too (nothing is truncated), but
    only when one is drawn, which may be hours in, and a resumed run draws the same problem again.
    Only the tokenizer and the model's config are loaded, not its weights.
    """
    from transformers import AutoConfig, AutoTokenizer

    from mint.models import context_length, resolve_weights
    from rewards import datasets

    weights = resolve_weights(base_model)
    tokenizer = AutoTokenizer.from_pretrained(weights)
    context = context_length(AutoConfig.from_pretrained(weights))
    held_out = ("eval_dataset" if eval_dataset else "dataset", datasets.eval_set(eval_dataset or dataset, eval_size))
    for field, problems in (("dataset", datasets.train_set(dataset)), held_out):
        lengths = {p["id"]: len(render_prompt(tokenizer, p["question"], prompt_template)) for p in problems}
        too_long = {k: n for k, n in lengths.items() if n + max_tokens > context}
        if too_long:
            longest = max(too_long, key=too_long.get)
            left = context - too_long[longest]
            fix = f"lower max_tokens to at most {left} or remove" if left > 0 else "shorten or remove"
            raise ValueError(f"{field}: {len(too_long)} of {len(lengths)} problems are too long for max_tokens="
                             f"{max_tokens} in {base_model}'s context of {context} tokens (longest: problem "
                             f"{longest!r}, {too_long[longest]} prompt tokens; first ones: {sorted(too_long)[:5]}); "
                             f"{fix} those problems (nothing is truncated)")


def is_transient(exc: BaseException) -> bool:
    """Errors worth a retry: memory pressure and I/O hiccups, never bad input."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower():
        return True
    return isinstance(exc, (TimeoutError, ConnectionError, InterruptedError))


def retry_on_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry only transient failures."""
    try:
        state.result()
    except Exception as exc:  # the task's own exception
        return is_transient(exc)
    return False


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry anything but a missing or corrupted input (the flow remakes
    it) or a full disk (a retry cannot help)."""
    try:
        state.result()
    except Exception as exc:
        return not isinstance(exc, (ArtifactError, CheckpointError, FileNotFoundError, DiskFullError))
    return False


# Task options: compute stages retry only transient errors; reward stages (judges, sandboxes) retry any error
# but a bad input artifact.
TRANSIENT_RETRIES = dict(retries=2, retry_delay_seconds=[2, 8], retry_condition_fn=retry_on_transient)
REWARD_RETRIES = dict(retries=3, retry_delay_seconds=[1, 2, 4], retry_condition_fn=retry_unless_bad_input)
