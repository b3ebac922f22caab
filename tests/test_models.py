"""Model resolution: the embedded GGUF, local folders, and the Qwen3 architecture path."""

import json
from pathlib import Path

import pytest
import torch
from conftest import EMBEDDED
from transformers import AutoModelForCausalLM, Qwen3Config

import mint
from mint import models, types

pytestmark = pytest.mark.model


def test_embedded_model_resolves_offline_to_a_converted_safetensors_folder():
    folder = models.resolve_weights(EMBEDDED)
    assert (models.cache_dir() / "models").as_posix() in folder
    source = json.loads(open(f"{folder}/mintflow-source.json").read())
    assert source["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (Path(folder) / "model.safetensors").is_file() and (Path(folder) / "tokenizer.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "llama"


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        models.resolve_weights(str(tmp_path))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, tokenizer):
    """A random-init Qwen3 with the embedded tokenizer: the Qwen3 code path without a download."""
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_qwen3_trains_and_samples(tiny_qwen3, tmp_path):
    service = mint.ServiceClient(checkpoint_dir=tmp_path)
    tc = service.create_lora_training_client(tiny_qwen3, rank=4, seed=0)
    assert tc.get_info().model_data["arch"] == "qwen3"
    tokens = list(range(10, 30))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 19})
    before = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < before
    sampler = tc.save_weights_and_get_sampling_client("qwen3")
    out = sampler.sample(types.ModelInput.from_ints(tokens[:5]), 3, types.SamplingParams(max_tokens=4, seed=0)).result()
    assert len(out.sequences) == 3
    for seq in out.sequences:
        assert 1 <= len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)
        assert len(seq.tokens) == 4 or seq.stop_reason == "stop"
