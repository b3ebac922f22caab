"""The mint engine on the embedded SmolLM2-135M-Instruct: training, checkpoints, sampling."""

import asyncio
import gc
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import EMBEDDED, chat_prompt, grads_snapshot, lora_snapshot, sft_datum

from mint import grpo, types

pytestmark = pytest.mark.model

QA = [("What is 2 + 2?", "4"), ("What is the capital of France?", "Paris"),
      ("What color is the sky?", "Blue"), ("What is 10 - 3?", "7")]


def test_sft_on_a_handful_of_examples_lowers_the_loss(service, tokenizer):
    tc = service.create_lora_training_client(EMBEDDED, rank=8, seed=0)
    data = [sft_datum(tokenizer, q, a) for q, a in QA]
    first = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    for _ in range(4):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    last = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert last < 0.5 * first


def test_forward_reports_per_datum_logprobs_and_no_gradients(service, tokenizer):
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0)
    data = [sft_datum(tokenizer, q, a) for q, a in QA[:2]]
    out = tc.forward(data, "cross_entropy").result()
    assert [len(o["logprobs"]) for o in out.loss_fn_outputs] == [d.model_input.length for d in data]
    weighted = sum(float((o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum())
                   for o, d in zip(out.loss_fn_outputs, data))
    assert out.metrics["loss:sum"] == pytest.approx(-weighted, rel=1e-5)
    assert all(p.grad is None for p in tc._params)


def test_gradients_accumulate_across_calls_until_optim_step(service_fp32, tokenizer):
    data = [sft_datum(tokenizer, q, a) for q, a in QA]
    whole = service_fp32.create_lora_training_client(EMBEDDED, rank=4, seed=1)
    whole.forward_backward(data, "cross_entropy").result()
    split = service_fp32.create_lora_training_client(EMBEDDED, rank=4, seed=1)
    split.forward_backward(data[:2], "cross_entropy").result()
    split.forward_backward(data[2:], "cross_entropy").result()
    for g_whole, g_split in zip(grads_snapshot(whole).values(), grads_snapshot(split).values()):
        if g_whole is not None:
            assert torch.allclose(g_whole, g_split, rtol=1e-3, atol=1e-6)
    split.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert all(p.grad is None for p in split._params)


def test_a_batch_with_all_weights_zero_adds_no_gradient(service, tokenizer):
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0)
    datum = sft_datum(tokenizer, *QA[0])
    masked = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        "target_tokens": datum.loss_fn_inputs["target_tokens"], "weights": [0.0] * datum.model_input.length})
    out = tc.forward_backward([masked], "cross_entropy").result()
    assert out.metrics["loss:sum"] == 0.0 and all(p.grad is None for p in tc._params)


def test_optim_step_clips_and_reports_the_gradient_norm(service, tokenizer):
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0)
    tc.forward_backward([sft_datum(tokenizer, q, a) for q, a in QA], "cross_entropy").result()
    metrics = tc.optim_step(types.AdamParams(learning_rate=0.0, grad_clip_norm=1e-3)).result().metrics
    assert metrics["grad_norm"] > 1e-3 and metrics["step"] == 1


def test_save_and_load_state_resume_exactly(service, tokenizer, tmp_path):
    data = [sft_datum(tokenizer, q, a) for q, a in QA]
    adam = types.AdamParams(learning_rate=1e-3)
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=3)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()
    path = tc.save_state(str(tmp_path / "ckpt")).result().path
    logprobs = [o["logprobs"].tolist() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    after = lora_snapshot(tc)

    resumed = service.create_training_client_from_state(path)
    assert resumed.step == 2
    assert [o["logprobs"].tolist() for o in resumed.forward(data, "cross_entropy").result().loss_fn_outputs] == logprobs
    resumed.forward_backward(data, "cross_entropy").result()
    resumed.optim_step(adam).result()
    for key, value in lora_snapshot(resumed).items():
        assert torch.equal(value, after[key])

    # load_state alone resets Adam's moments, so the next update differs.
    fresh = service.create_lora_training_client(EMBEDDED, rank=4, seed=99)
    fresh.load_state(path).result()
    fresh.forward_backward(data, "cross_entropy").result()
    fresh.optim_step(adam).result()
    assert any(not torch.equal(v, after[k]) for k, v in lora_snapshot(fresh).items())


def test_a_checkpoint_loads_in_a_new_process(service, tokenizer, tmp_path):
    data = [sft_datum(tokenizer, q, a) for q, a in QA[:1]]
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=5)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_state(str(tmp_path / "cross-process")).result().path
    expected = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    tokens = data[0].model_input.to_ints()
    targets = data[0].loss_fn_inputs["target_tokens"].tolist()
    weights = data[0].loss_fn_inputs["weights"].tolist()
    script = f"""
import json, mint
from mint import types
service = mint.ServiceClient(checkpoint_dir={str(tmp_path)!r})
tc = service.create_training_client_from_state({path!r})
datum = types.Datum(model_input=types.ModelInput.from_ints({tokens}),
                    loss_fn_inputs={{"target_tokens": {targets}, "weights": {weights}}})
print(json.dumps(tc.forward([datum], "cross_entropy").result().metrics))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1])["loss:sum"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("dtype_service, bound", [("service_fp32", 1e-3), ("service", 0.1)])
def test_sampler_logprobs_agree_with_the_training_forward(request, tokenizer, dtype_service, bound):
    service = request.getfixturevalue(dtype_service)
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0)
    for _ in range(2):  # move the adapter away from B = 0, so the LoRA path matters
        tc.forward_backward([sft_datum(tokenizer, q, a) for q, a in QA], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client("agree")
    prompts = [chat_prompt(tokenizer, f"What is {a} + {b}?") for a, b in [(3, 4), (12, 9)]]
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=0)
    futures = [sampler.sample(types.ModelInput.from_ints(p), 4, params) for p in prompts]
    datums = [d for p, f in zip(prompts, futures)
              for d in grpo.group_datums(p, f.result().sequences, [0.0] * 4)]
    out = tc.forward(datums, "importance_sampling").result()
    diffs = np.concatenate([
        np.abs(o["logprobs"].to_numpy() - d.loss_fn_inputs["logprobs"].to_numpy())[
            d.loss_fn_inputs["weights"].to_numpy() > 0]
        for o, d in zip(out.loss_fn_outputs, datums)])
    print(f"{dtype_service}: mean |sampler - trainer| logprob = {diffs.mean():.2e} over {diffs.size} tokens")
    assert diffs.mean() <= bound


def _prompt(tokenizer, text="Count from 1 to 20."):
    return types.ModelInput.from_ints(chat_prompt(tokenizer, text))


def test_greedy_sampling_is_deterministic_and_equals_top_k_1(service, tokenizer):
    sc = service.create_sampling_client(base_model=EMBEDDED)
    greedy = sc.sample(_prompt(tokenizer), 2, types.SamplingParams(max_tokens=10, temperature=0.0)).result()
    top1 = sc.sample(_prompt(tokenizer), 1, types.SamplingParams(max_tokens=10, temperature=1.5, top_k=1)).result()
    assert greedy.sequences[0].tokens == greedy.sequences[1].tokens == top1.sequences[0].tokens


def test_seed_makes_sampling_reproducible(service, tokenizer):
    sc = service.create_sampling_client(base_model=EMBEDDED)

    def draw(seed):
        params = types.SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=seed)
        return [s.tokens for s in sc.sample(_prompt(tokenizer), 3, params).result().sequences]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_max_tokens_and_stop_conditions(service, tokenizer):
    sc = service.create_sampling_client(base_model=EMBEDDED)
    prompt = _prompt(tokenizer)
    long = sc.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    assert len(long.tokens) == 6 and long.stop_reason == "length" and len(long.logprobs) == 6
    text = tokenizer.decode(long.tokens)
    stop_token = long.tokens[3]
    by_id = sc.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_token])).result()
    assert by_id.sequences[0].tokens == long.tokens[:long.tokens.index(stop_token) + 1]
    assert by_id.sequences[0].stop_reason == "stop"
    by_key = sc.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0,
                                                       stop_token_ids=[stop_token])).result()
    assert by_key.sequences[0].tokens == by_id.sequences[0].tokens
    stop_text = tokenizer.decode(long.tokens[2:4])
    by_string = sc.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=stop_text)).result()
    assert stop_text in tokenizer.decode(by_string.sequences[0].tokens) and by_string.sequences[0].stop_reason == "stop"
    assert len(by_string.sequences[0].tokens) <= 4 and text.startswith(tokenizer.decode(by_string.sequences[0].tokens))
    # The chat model ends its turn with <|im_end|>, the tokenizer's EOS: a stop by default.
    short = sc.sample(_prompt(tokenizer, "Say hi."), 1, types.SamplingParams(max_tokens=40, temperature=0.0)).result()
    assert short.sequences[0].stop_reason == "stop" and short.sequences[0].tokens[-1] == tokenizer.eos_token_id
    zero = sc.sample(prompt, 2, types.SamplingParams(max_tokens=0)).result()
    assert [s.tokens for s in zero.sequences] == [[], []]


def test_queued_requests_are_batched_and_match_individual_greedy_runs(service, tokenizer):
    sc = service.create_sampling_client(base_model=EMBEDDED)
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [_prompt(tokenizer, f"What is {a} + {a}?") for a in (1, 17)] + [_prompt(tokenizer)]
    futures = [sc.sample(p, 2, greedy) for p in prompts]
    assert not any(f.done() for f in futures)  # nothing runs until a result is asked for
    batched = [f.result() for f in futures]
    alone = [sc.sample(p, 1, greedy).result() for p in prompts]
    for b, a in zip(batched, alone):
        # Padding changes bf16 rounding, so compare the first tokens, where greedy choices are clear.
        assert b.sequences[0].tokens[:3] == a.sequences[0].tokens[:3]


def test_prompt_logprobs_match_compute_logprobs(service, tokenizer):
    sc = service.create_sampling_client(base_model=EMBEDDED)
    prompt = _prompt(tokenizer, "Hello there")
    response = sc.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                         topk_prompt_logprobs=3).result()
    direct = sc.compute_logprobs(prompt).result()
    assert response.prompt_logprobs[0] is None and direct[0] is None
    assert len(direct) == prompt.length
    assert np.allclose(response.prompt_logprobs[1:], direct[1:], atol=0.05)
    top = response.topk_prompt_logprobs[5]
    assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]


def test_async_twins_return_awaitable_futures(service, tokenizer):
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0)
    data = [sft_datum(tokenizer, q, a) for q, a in QA[:2]]

    async def run():
        fb = await tc.forward_backward_async(data, "cross_entropy")
        step = await tc.optim_step_async(types.AdamParams(learning_rate=1e-4))
        sampler = await tc.save_weights_and_get_sampling_client_async("async")
        sample = await sampler.sample_async(_prompt(tokenizer), 2, types.SamplingParams(max_tokens=3))
        return await fb, await step, await sample

    fb, step, sample = asyncio.run(run())
    assert "loss:sum" in fb.metrics and step.metrics["step"] == 1 and len(sample.sequences) == 2


def test_sampling_client_is_a_snapshot(service, tokenizer):
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0)
    sc = tc.save_weights_and_get_sampling_client("snapshot")
    prompt = _prompt(tokenizer, "Hello")
    before = sc.compute_logprobs(prompt).result()
    data = [sft_datum(tokenizer, q, a) for q, a in QA]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert sc.compute_logprobs(prompt).result() == before
    assert tc.save_weights_and_get_sampling_client("later").compute_logprobs(prompt).result() != before


def test_the_sampling_model_shares_the_base_weights_and_never_writes_them(service, tokenizer):
    from mint import lora

    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0, train_unembed=True)
    tc.forward_backward([sft_datum(tokenizer, q, a) for q, a in QA], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    base = tc.base
    q_proj = "model.layers.0.self_attn.q_proj"
    base_q, base_embed = lora._base_weight(base.model, q_proj), base.model.get_input_embeddings().weight
    before = (base_q.clone(), base_embed.clone())
    tc.save_weights_and_get_sampling_client("shares").compute_logprobs(_prompt(tokenizer, "Hi")).result()
    model = base.sampling_model
    assert model.get_input_embeddings().weight.data_ptr() == base_embed.data_ptr()   # never adapted: shared
    assert model.get_submodule(q_proj).weight.data_ptr() != base_q.data_ptr()       # adapted: private
    assert model.get_output_embeddings().weight.data_ptr() != base_embed.data_ptr()  # the adapted tied head too
    service.create_sampling_client(base_model=EMBEDDED).compute_logprobs(_prompt(tokenizer, "Hi")).result()
    assert model.get_submodule(q_proj).weight.data_ptr() == base_q.data_ptr()       # base again: shared again
    assert torch.equal(base_q, before[0]) and torch.equal(base_embed, before[1])


def test_info_and_tokenizer(service):
    tc = service.create_lora_training_client(EMBEDDED, rank=4, seed=0, train_unembed=False)
    info = tc.get_info()
    assert info.lora_rank == 4 and info.model_data["arch"] == "llama"
    assert "lm_head" not in info.model_data["target_modules"] and "q_proj" in info.model_data["target_modules"]
    assert tc.get_tokenizer().eos_token == "<|im_end|>"


def test_a_released_clients_adapter_is_deleted_at_the_next_new_client_not_inside_garbage_collection(service):
    # A finalizer can run in the middle of peft code holding the model's lock (an RLock): deleting an
    # adapter there changed the adapters under a running state-dict walk ("peft state keys changed layout").
    client = service.create_lora_training_client(EMBEDDED, rank=2, seed=1)
    base, name = client.base, client.adapter
    del client
    gc.collect()
    assert name in base.peft_model.peft_config and name in base.retired_adapters
    other = service.create_lora_training_client(EMBEDDED, rank=2, seed=2)
    assert name not in base.peft_model.peft_config and not base.retired_adapters
    assert other.adapter in base.peft_model.peft_config


KERNEL_CACHE_PROBE = """
import torch
from mint.models import load_base_model
load_base_model("embedded")
weight = torch.randn(64, 64, dtype=torch.bfloat16)
for rows in [2, *range(3, 303), 2]:  # the first shape, 300 others, the first again (1 row skips oneDNN)
    torch.randn(rows, 64, dtype=torch.bfloat16) @ weight
"""


@pytest.mark.parametrize("capacity, last_lookup", [(None, "cache_miss"), ("1024", "cache_hit")])
def test_the_engine_bounds_the_cpu_kernel_cache_unless_the_user_sets_it(capacity, last_lookup):
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    env.update(ONEDNN_VERBOSE="2", **({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity} if capacity else {}))
    out = subprocess.run([sys.executable, "-c", KERNEL_CACHE_PROBE], env=env, capture_output=True, text=True,
                         check=True)
    lookups = [line.split(",")[3] for line in out.stdout.splitlines() if ",create:cache_" in line]
    if not lookups:
        pytest.skip("torch does not run bf16 matmuls through oneDNN on this CPU")
    # 300 shapes pushed the first one out of a 256-kernel cache; a 1024-kernel cache still holds it
    assert lookups[-1] == f"create:{last_lookup}"
