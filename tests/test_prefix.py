"""Shared prompts and micro-batches in the training forward: the same numbers as one plain forward.

The trainer runs each distinct prompt once and the responses on its copied KV cache, and
splits big batches into micro-batches. Both are exact rewrites; these tests hold them to a
plain full-sequence forward of the same adapter, in float32.
"""

import pytest
import torch
from conftest import EMBEDDED, chat_prompt, grads_snapshot, sft_datum

from mint import lora, prefix, types
from mint.losses import importance_sampling

W = torch.tensor


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 2e-2) -> None:
    """Relative to the tensor's norm. The tolerance is float32's, not slack: near-certain tokens make the
    logprob gradient a difference of near-equal terms, and on this batch the trainer's and the plain
    forward's float32 gradients each differ from a float64 computation by up to ~3e-3 (median 7e-4).
    Losing the gradient through the shared prompt's cache gives errors of order 1."""
    error = float((actual - expected).norm() / expected.norm().clamp_min(1e-12))
    assert error < tol, f"{what}: relative error {error:.1e}"


def test_datums_share_a_prompt_only_with_an_identical_one():
    tokens = [[1, 2, 3, 7, 8], [1, 2, 3, 9], [1, 2, 4, 7], [5, 6]]
    weights = [W([0.0, 0, 1, 1, 1]), W([0.0, 0, 1, 1]), W([0.0, 0, 1, 1]), W([0.0, 1])]
    # Prompt = leading zero-weight positions + the token whose hidden state predicts the first weighted target.
    assert prefix.shared_prompt_lengths(tokens, weights) == [3, 3, 0, 0]
    assert prefix.shared_prompt_lengths(tokens, None) == [0, 0, 0, 0]
    assert prefix.prompt_groups(tokens, [3, 3, 0, 0]) == [[0, 1], [2], [3]]


def test_the_layout_puts_every_token_in_exactly_one_place():
    tokens = [[1, 2, 3, 7, 8], [1, 2, 3, 9], [1, 2, 4, 7], [5, 6]]
    layout = prefix.layout(tokens, [3, 3, 0, 0])
    assert layout.prompt_ids.tolist() == [[1, 2, 3]]          # the shared prompt runs once
    assert layout.response_ids.tolist() == [[7, 8, 0, 0], [9, 0, 0, 0], [1, 2, 4, 7], [5, 6, 0, 0]]
    assert layout.response_positions[0, :2].tolist() == [3, 4]  # responses continue their prompt's positions
    assert layout.context_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0]]  # unshared: no context
    cells = torch.cat([layout.prompt_ids.flatten(), layout.response_ids.flatten()])
    assert cells[layout.rows].tolist() == [t for seq in tokens for t in seq]
    assert layout.padded_tokens == 3 + 4 * 4


def _mixed_batch(tokenizer, sampler):
    """Two prompts x three sampled responses (shared prompts), plus two SFT datums (nothing shared)."""
    datums = []
    for seed, question in enumerate(["Describe the sea in one long sentence.", "Tell me a story about a cat."]):
        prompt = chat_prompt(tokenizer, question)
        result = sampler.sample(types.ModelInput.from_ints(prompt), 3,
                                types.SamplingParams(max_tokens=8, temperature=1.0, seed=seed)).result()
        for i, s in enumerate(result.sequences):
            tokens = prompt + s.tokens
            n, p = len(tokens) - 1, len(prompt) - 1
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "weights": [0.0] * p + [1.0] * (n - p),
                "logprobs": [0.0] * p + list(s.logprobs), "advantages": [0.0] * p + [0.5 - i * 0.4] * (n - p)}))
    for q, a in [("Name a color.", "Blue"), ("What is 2 + 2?", "4")]:
        sft = sft_datum(tokenizer, q, a)
        n = sft.model_input.length
        datums.append(types.Datum(model_input=sft.model_input, loss_fn_inputs={
            **sft.loss_fn_inputs, "logprobs": [-1.0] * n, "advantages": [0.3] * n}))
    return datums


def _plain_forward_backward(tc, datums):
    """Reference: every datum's full sequence through the model, right-padded, loss summed, one backward."""
    width = max(d.model_input.length for d in datums)
    ids = torch.zeros(len(datums), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(datums):
        ids[i, :d.model_input.length] = torch.tensor(d.model_input.to_ints())
        mask[i, :d.model_input.length] = 1
    with lora.active(tc.base, tc.adapter) as model, torch.enable_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        logprobs = [logits[i, :d.model_input.length].gather(
            -1, torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy())[:, None]).squeeze(-1)
            for i, d in enumerate(datums)]
        inputs = {k: torch.cat([torch.from_numpy(d.loss_fn_inputs[k].to_numpy()) for d in datums])
                  for k in ("weights", "logprobs", "advantages")}
        importance_sampling(torch.cat(logprobs), inputs, {}).backward()
    return [lp.detach() for lp in logprobs]


@pytest.fixture(scope="module")
def trained(service_fp32, tokenizer):
    """A float32 client whose adapter has moved off B = 0 (so LoRA changes the numbers), and a mixed batch."""
    tc = service_fp32.create_lora_training_client(EMBEDDED, rank=4, seed=0)
    for _ in range(2):
        tc.forward_backward([sft_datum(tokenizer, "What is 1 + 1?", "2")], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    datums = _mixed_batch(tokenizer, tc.save_weights_and_get_sampling_client("prefix"))
    shared = prefix.shared_prompt_lengths(*_tokens_and_weights(datums))
    assert shared.count(0) == 2  # 6 datums share 2 prompts, 2 stand alone
    assert all(d.model_input.length - m >= 4 for d, m in zip(datums, shared) if m)  # responses to run on the cache
    return tc, datums


def _tokens_and_weights(datums):
    return ([d.model_input.to_ints() for d in datums],
            [torch.from_numpy(d.loss_fn_inputs["weights"].to_numpy()) for d in datums])


def test_shared_prompts_give_the_plain_forwards_logprobs_and_gradients(trained):
    tc, datums = trained
    expected = _plain_forward_backward(tc, datums)
    expected_grads = grads_snapshot(tc)
    for p in tc._params:
        p.grad = None
    out = tc.forward_backward(datums, "importance_sampling").result()
    for o, lp in zip(out.loss_fn_outputs, expected):
        assert torch.allclose(torch.from_numpy(o["logprobs"].to_numpy()), lp, atol=1e-4)
    for name, grad in grads_snapshot(tc).items():
        assert_close(grad, expected_grads[name], f"gradient {name}")
    for p in tc._params:
        p.grad = None


@pytest.mark.parametrize("budget", [1, 64, 200])
def test_micro_batches_give_the_whole_batchs_logprobs_and_gradients(trained, budget):
    tc, datums = trained
    runs = {}
    for tokens in (100_000, budget):
        tc.micro_batch_tokens = tokens
        out = tc.forward_backward(datums, "importance_sampling").result()
        runs[tokens] = ([o["logprobs"].to_numpy() for o in out.loss_fn_outputs], out.metrics["loss:sum"],
                        grads_snapshot(tc))
        for p in tc._params:
            p.grad = None
    tc.micro_batch_tokens = 100_000
    (whole_lp, whole_loss, whole_grads), (split_lp, split_loss, split_grads) = runs[100_000], runs[budget]
    assert split_loss == pytest.approx(whole_loss, rel=1e-4, abs=1e-5)
    for a, b in zip(whole_lp, split_lp):
        assert torch.allclose(torch.from_numpy(a), torch.from_numpy(b), atol=1e-4)
    for name, grad in whole_grads.items():
        assert_close(split_grads[name], grad, f"gradient {name}")


def test_micro_batches_keep_prompt_groups_together_and_respect_the_budget(trained, service_fp32):
    tc, datums = trained
    from mint.training import Batch

    batch = Batch(datums, tc.base.vocab_size, ("target_tokens",))
    parts = batch.micro_batches(60)
    assert sorted(i for indices, _ in parts for i in indices) == list(range(len(datums)))
    groups = prefix.prompt_groups(batch.tokens, batch.prompt_lengths)
    for indices, part in parts:
        assert all(set(g) <= set(indices) or not set(g) & set(indices) for g in groups)
        assert part.layout.padded_tokens <= 60 or len(prefix.prompt_groups(part.tokens, part.prompt_lengths)) == 1


def test_a_custom_loss_over_micro_batches_gets_the_exact_gradient(trained):
    """A loss that is not a sum over tokens (the square of each datum's mean logprob) still gets the
    whole batch's gradient: the trainer backpropagates its gradient w.r.t. the logprobs per micro-batch."""
    tc, datums = trained

    def loss_fn(data, logprobs):
        means = torch.stack([(lp * torch.from_numpy(d.loss_fn_inputs["weights"].to_numpy())).sum()
                             / d.loss_fn_inputs["weights"].to_numpy().sum() for d, lp in zip(data, logprobs)])
        return (means ** 2).sum(), {"mean": float(means.mean())}

    runs = {}
    for tokens in (100_000, 50):
        tc.micro_batch_tokens = tokens
        out = tc.forward_backward_custom(datums, loss_fn).result()
        runs[tokens] = (out.metrics, grads_snapshot(tc))
        for p in tc._params:
            p.grad = None
    tc.micro_batch_tokens = 100_000
    assert runs[50][0]["loss:sum"] == pytest.approx(runs[100_000][0]["loss:sum"], rel=1e-5)
    for name, grad in runs[100_000][1].items():
        assert_close(runs[50][1][name], grad, f"gradient {name}")
