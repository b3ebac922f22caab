"""Tasks that make checkpoints: a fresh policy, the SFT warm start, and one GRPO update."""

from __future__ import annotations

import time

import torch
from prefect import task

from mint import types
from mint.checkpoints import failpoint
from rewards import datasets
from tasks.common import (
    TRANSIENT_RETRIES,
    Artifact,
    checkpoint_artifact,
    checkpoint_dir,
    content_key,
    derived_seed,
    forget,
    read_json,
    render_prompt,
    resume_from,
    save_from,
    service,
    task_cache_key,
    trainer,
)


@task(name="init_policy", cache_key_fn=task_cache_key, persist_result=True, **TRANSIENT_RETRIES)
def init_policy(base_model: str, rank: int, train_unembed: bool, seed: int) -> Artifact:
    """A fresh LoRA adapter (B = 0, so the policy starts as the base model), seeded."""
    key = content_key("init_policy", dict(locals()))  # = this call's arguments
    fresh = service().create_lora_training_client(base_model, rank=rank, seed=seed, train_unembed=train_unembed)
    return checkpoint_artifact(fresh.save_state(str(checkpoint_dir(key))).result().path)


@task(name="sft_warm_start", cache_key_fn=task_cache_key, persist_result=True, **TRANSIENT_RETRIES)
def sft_warm_start(policy: Artifact, base_model: str, rank: int, train_unembed: bool, dataset: str, steps: int,
                   batch_size: int, learning_rate: float, seed: int) -> tuple[Artifact, dict]:
    """Supervised warm start: cross-entropy on demonstrations (the reference answer after the prompt)."""
    key = content_key("sft_warm_start", dict(locals()))  # = this call's arguments
    client = trainer(base_model, rank, train_unembed)
    forget(client)
    client.load_state(policy.path).result()  # fresh optimizer for the SFT stage
    tokenizer = client.get_tokenizer()
    adam = types.AdamParams(learning_rate=learning_rate, grad_clip_norm=1.0)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        batch = datasets.train_batch(dataset, batch_size, derived_seed(seed, "sft", step))
        data = []
        for example in batch:
            prompt = render_prompt(tokenizer, example["question"])
            answer = tokenizer.encode(str(example.get("solution", example["answer"])) + tokenizer.eos_token,
                                      add_special_tokens=False)
            tokens = prompt + answer
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)}))
        out = client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
        failpoint("sft_warm_start:stepped")  # the warm client changed, nothing saved
        losses.append(out.metrics["loss:sum"] / sum(sum(d.loss_fn_inputs["weights"].data) for d in data))
    return save_from(client, key), {"sft_loss_first": losses[0] if losses else 0.0,
                                       "sft_loss_last": losses[-1] if losses else 0.0,
                                       "sft_seconds": time.perf_counter() - start}


@task(name="train", cache_key_fn=task_cache_key, persist_result=True, **TRANSIENT_RETRIES)
def train(policy: Artifact, batch: Artifact, base_model: str, rank: int, train_unembed: bool, loss_fn: str,
          loss_fn_config: dict, learning_rate: float, grad_clip_norm: float, iteration: int) -> tuple[Artifact, dict]:
    """One optimizer step of ``loss_fn`` on the batch's datums, from ``policy``; returns the new checkpoint."""
    key = content_key("train", dict(locals()))  # = this call's arguments
    datums = [types.Datum.model_validate(d) for d in read_json(batch)["datums"]]
    client = trainer(base_model, rank, train_unembed)
    resume_from(client, policy)
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    if datums:
        out = client.forward_backward(datums, loss_fn, loss_fn_config or None).result()
        step = client.optim_step(types.AdamParams(learning_rate=learning_rate, grad_clip_norm=grad_clip_norm)).result()
        failpoint("train:stepped")  # the warm client changed, nothing saved
        mask = torch.cat([d.loss_fn_inputs["weights"].to_torch() for d in datums]) > 0
        learner = torch.cat([o["logprobs"].to_torch() for o in out.loss_fn_outputs])[mask]
        sampler = torch.cat([d.loss_fn_inputs["logprobs"].to_torch() for d in datums])[mask]
        tokens = int(sum(d.model_input.length for d in datums))
        metrics = {"loss": out.metrics["loss:sum"], "grad_norm": step.metrics["grad_norm"],
                   "kl_sample_train": float((sampler - learner).mean()),
                   "entropy": float(-sampler.mean()), "train_tokens": tokens}
    seconds = time.perf_counter() - start
    metrics.update(train_seconds=seconds, train_tokens_per_s=metrics.get("train_tokens", 0) / max(seconds, 1e-9))
    policy = save_from(client, key)
    failpoint("train:checkpoint_written")  # the new checkpoint is on disk, the task's result is not
    return policy, metrics
