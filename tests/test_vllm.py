"""The vLLM sampling backend. Its GPU path needs CUDA and vLLM; what does not (the mapping of
sampling parameters, the conversion of vLLM's outputs, the adapter export) is tested here."""

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from flows.config import build_config
from mint import types
from mint.vllm_sampling import adapter_id, export_adapter, to_sample_response, vllm_sampling_kwargs

EMBEDDED = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_sampling_parameters_map_onto_vllms():
    params = types.SamplingParams(max_tokens=16, temperature=0.8, seed=3, stop=["\n\n"], top_p=0.9,
                                  stop_token_ids=[7])
    assert vllm_sampling_kwargs(params, 4, stop_token_ids=[2, 7]) == {
        "n": 4, "temperature": 0.8, "top_p": 0.9, "max_tokens": 16, "seed": 3, "logprobs": 0,
        "stop_token_ids": [2, 7], "stop": ["\n\n"]}
    assert vllm_sampling_kwargs(types.SamplingParams(top_k=20), 1, [])["top_k"] == 20
    assert "top_k" not in vllm_sampling_kwargs(types.SamplingParams(), 1, [])  # -1 = off: vLLM's default


def test_vllm_outputs_become_sample_responses():
    logprob = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    output = SimpleNamespace(outputs=[
        SimpleNamespace(token_ids=[5, 9], logprobs=[{5: logprob(-0.5), 1: logprob(-2.0)}, {9: logprob(-0.25)}],
                        finish_reason="stop"),
        SimpleNamespace(token_ids=[4], logprobs=[{4: logprob(-1.5)}], finish_reason="length")])
    response = to_sample_response(output)
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences] == [
        ([5, 9], [-0.5, -0.25], "stop"), ([4], [-1.5], "length")]


@pytest.mark.model
def test_an_exported_adapter_is_peft_layout_and_gives_our_samplers_logits(service_fp32, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mint.models import resolve_weights

    service = service_fp32
    client = service.create_lora_training_client(EMBEDDED, rank=8, seed=0, train_unembed=False)
    torch.manual_seed(0)
    with torch.no_grad():  # a non-zero adapter, so the comparison means something
        for p in client._params:
            p.add_(0.02 * torch.randn_like(p))
    checkpoint = client.save_weights_for_sampler(str(tmp_path / "policy")).result().path
    exported = export_adapter(checkpoint, tmp_path / "vllm-adapter")
    assert sorted(p.name for p in exported.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert adapter_id(checkpoint) == adapter_id(checkpoint) > 0

    base = AutoModelForCausalLM.from_pretrained(resolve_weights(EMBEDDED), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(exported)).eval()
    tokens = [1, 504, 3458, 314, 253, 1345]
    with torch.no_grad():
        logits = peft_model(torch.tensor([tokens])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    ours = service.create_sampling_client(model_path=checkpoint).compute_logprobs(
        types.ModelInput.from_ints(tokens)).result()[1:]
    assert torch.allclose(torch.tensor(ours), expected, atol=1e-3)
    with torch.no_grad(), peft_model.disable_adapter():  # and the adapter is not a no-op
        plain = torch.log_softmax(peft_model(torch.tensor([tokens])).logits[0].float(), -1)
    assert (plain[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])] - expected).abs().max() > 0.05


@pytest.mark.model
def test_an_adapter_on_the_unembedding_is_refused_for_vllm(service, tmp_path):
    client = service.create_lora_training_client(EMBEDDED, rank=4, seed=0, train_unembed=True)
    checkpoint = client.save_weights_for_sampler(str(tmp_path / "policy")).result().path
    config = json.loads((tmp_path / "policy" / "adapter_config.json").read_text())
    assert "lm_head" in config["target_modules"]
    with pytest.raises(ValueError, match="train_unembed"):
        export_adapter(checkpoint, tmp_path / "out")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_choosing_vllm_without_it_is_refused_before_any_work():
    with pytest.raises(ValueError, match="sampler 'vllm' needs vLLM"):
        build_config("math", ["sampler=vllm"])


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="the vLLM backend runs on CUDA with the vllm extra; neither is on this machine")
def test_vllm_samples_a_checkpoint_with_logprobs_close_to_the_trainers(service, tmp_path):
    from tasks.common import sampling_client

    client = service.create_lora_training_client(EMBEDDED, rank=8, seed=0, train_unembed=False)
    checkpoint = client.save_weights_for_sampler(str(tmp_path / "policy")).result().path
    sampler = sampling_client(checkpoint, "vllm", 0.3)
    prompt = types.ModelInput.from_ints(sampler.get_tokenizer().encode("What is 2 + 3?"))
    [sequence] = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=1.0, seed=0)) \
        .result().sequences
    trainer = service.create_sampling_client(model_path=checkpoint).compute_logprobs(
        types.ModelInput.from_ints(prompt.to_ints() + sequence.tokens)).result()[-len(sequence.tokens):]
    assert max(abs(a - b) for a, b in zip(sequence.logprobs, trainer)) < 0.2
