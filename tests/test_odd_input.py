"""Odd text in prompts and data files: kept as written, or refused with the file, line, field or lengths named.

Nothing is truncated anywhere: a prompt or datum longer than the model's context
(``max_position_embeddings``, 8192 tokens for the embedded model) is refused at the call,
before it is queued, and ``max_tokens`` is never cut to fit.
"""

import json
import math

import pytest
import torch
from conftest import EMBEDDED, lora_snapshot, sft_datum

from mint import types
from rewards import datasets
from tasks.common import check_prompts_fit, render_prompt

GOOD = [json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}).encode() for i in range(3)]


def write_jsonl(tmp_path, *lines: bytes, name="problems.jsonl"):
    """A data file of the good lines, then ``lines`` (raw bytes, so that a test can write any byte)."""
    path = tmp_path / name
    path.write_bytes(b"\n".join([*GOOD, *lines]) + b"\n")
    return str(path)


# ------------------------------------------------------------------ data files (.jsonl)
BAD_LINES = [
    ("invalid UTF-8", b'{"question": "caf\xe9 au lait?", "answer": "1"}', r":4: not UTF-8 \(byte 0xe9 at column 18\)"),
    ("not JSON", b"{question: 1}", r":4: not valid JSON \(Expecting property name enclosed in double quotes"),
    ("truncated JSON", b'{"question": "What is 2', r":4: not valid JSON"),
    ("a JSON array", b'["What is 2 + 2?", "4"]', r":4: expected a JSON object, got a JSON array"),
    ("a JSON string", b'"question answer"', r":4: expected a JSON object, got a JSON string"),
    ("no answer", b'{"question": "What is 2 + 2?"}', r":4: each line needs 'question' and 'answer'; missing 'answer'$"),
    ("no question", b'{"prompt": "What is 2 + 2?", "answer": "4"}', r":4: each line needs .*; missing 'question'$"),
    ("empty question", b'{"question": "", "answer": "4"}', r":4: 'question' is empty"),
    ("blank question", b'{"question": " \\n\\t ", "answer": "4"}', r":4: 'question' is empty"),
    ("null question", b'{"question": null, "answer": "4"}', r":4: 'question' must be a string, got a JSON null"),
    ("numeric question", b'{"question": 7, "answer": "4"}', r":4: 'question' must be a string, got a JSON number"),
    ("null answer", b'{"question": "What is 2 + 2?", "answer": null}', r":4: 'answer' must be a string or a number, "
                                                                      r"got a JSON null"),
]


@pytest.mark.parametrize("case, line, message", BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_a_bad_line_in_a_data_file_is_refused_naming_the_file_and_line(tmp_path, case, line, message):
    path = write_jsonl(tmp_path, line)
    with pytest.raises(ValueError, match=r"dataset .*problems\.jsonl" + message) as raised:
        datasets.train_batch(path, 1, 0)
    assert raised.type is ValueError  # not a bare UnicodeDecodeError / JSONDecodeError / TypeError
    with pytest.raises(ValueError, match=message):  # evaluation reads the same file the same way
        datasets.eval_set(path, 1)


def test_a_bad_line_anywhere_is_found_when_the_file_is_loaded(tmp_path):
    """The whole file is checked at load, so a bad last line stops the run before it trains, not when drawn."""
    path = write_jsonl(tmp_path, *GOOD * 10, b'{"question": "What is 2 + 2?"}')
    with pytest.raises(ValueError, match=r":34: each line needs"):
        datasets.train_batch(path, 1, 0)


def test_control_characters_nul_and_odd_line_breaks_are_kept_as_written(tmp_path):
    escaped = json.dumps({"question": "NUL\x00 bell\x07 \x1b[31mred\x1b[0m \u2028sep", "answer": 5}).encode()
    raw = b'{"question": "tab\there \x01 cr\rhere nel\xc2\x85here", "answer": "x"}'  # invalid strict JSON, kept
    path = write_jsonl(tmp_path, escaped, raw)
    pool = datasets.load_pool(path)
    assert [p["question"] for p in pool[-2:]] == ["NUL\x00 bell\x07 \x1b[31mred\x1b[0m \u2028sep",
                                                  "tab\there \x01 cr\rhere nel\x85here"]
    assert [p["answer"] for p in pool[-2:]] == ["5", "x"]  # a number answer becomes its text, as before


def test_a_byte_order_mark_crlf_line_ends_and_blank_lines_are_accepted(tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join([GOOD[0], b"", b"  ", GOOD[1], GOOD[2]]) + b"\r\n")
    assert [p["answer"] for p in datasets.load_pool(str(path))] == ["1", "2", "3"]
    assert [p["id"] for p in datasets.load_pool(str(path))] == ["windows-1", "windows-4", "windows-5"]


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def sampler(service):
    return service.create_sampling_client(base_model=EMBEDDED)


@pytest.mark.model
def test_an_empty_prompt_is_refused_by_every_sampler_call(sampler):
    empty = types.ModelInput.empty()
    for call in (lambda: sampler.sample(empty, 1, types.SamplingParams(max_tokens=2)),
                 lambda: sampler.compute_logprobs(empty), lambda: sampler.next_token_logprobs(empty, [1])):
        with pytest.raises(ValueError, match=r"^prompt: empty \(needs at least one token\)$"):
            call()
    assert sampler._pending == []


@pytest.mark.model
def test_a_prompt_longer_than_the_context_is_refused_not_truncated(sampler):
    window = sampler.base.max_length
    assert window == sampler.base.model.config.max_position_embeddings == 8192
    too_long = types.ModelInput.from_ints([1] * (window + 1))
    message = r"^prompt: 8193 tokens exceed the model's context of 8192 \(max_position_embeddings\); shorten"
    for call in (lambda: sampler.sample(too_long, 1, types.SamplingParams(max_tokens=1)),
                 lambda: sampler.sample(too_long, 1, types.SamplingParams(max_tokens=None)),
                 lambda: sampler.compute_logprobs(too_long), lambda: sampler.next_token_logprobs(too_long, [1])):
        with pytest.raises(ValueError, match=message):
            call()
    assert sampler._pending == []  # refused at the call: nothing queued to run with the next batch


@pytest.mark.model
def test_max_tokens_beyond_what_the_context_leaves_is_refused_not_cut(sampler):
    prompt = types.ModelInput.from_ints([1] * (sampler.base.max_length - 3))
    with pytest.raises(ValueError, match=r"^sampling_params.max_tokens: 4 new tokens after a 8189-token prompt "
                                         r"exceed the model's context of 8192; use at most 3$"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4))
    assert sampler._pending == []


@pytest.mark.model
def test_at_the_context_boundary_sampling_fills_the_window_exactly(sampler, monkeypatch):
    """With the window shrunk to 24 tokens (so that the check runs in milliseconds): a prompt of 20 may
    generate 4 more, max_tokens=None means up to the window, and a prompt of exactly 24 generates none."""
    monkeypatch.setattr(sampler.base.model.config, "max_position_embeddings", 24)
    prompt = types.ModelInput.from_ints(sampler.get_tokenizer().encode("one two three " * 7)[:20])
    params = types.SamplingParams(temperature=0.0)
    four = sampler.sample(prompt, 1, params.model_copy(update={"max_tokens": 4})).result().sequences[0]
    to_the_end = sampler.sample(prompt, 1, params).result().sequences[0]
    assert (len(to_the_end.tokens), to_the_end.stop_reason) == (4, "length")
    assert to_the_end.tokens == four.tokens
    full = types.ModelInput.from_ints(prompt.to_ints() + [1] * 4)
    assert sampler.sample(full, 1, params).result().sequences[0].tokens == []
    with pytest.raises(ValueError, match="use at most 0"):
        sampler.sample(full, 1, params.model_copy(update={"max_tokens": 1}))
    with pytest.raises(ValueError, match="25 tokens exceed the model's context of 24"):
        sampler.sample(full.append_int(1), 1, params)


@pytest.fixture(scope="module")
def trainer(service):
    return service.create_lora_training_client(EMBEDDED, rank=2, seed=0)


@pytest.mark.model
def test_a_datum_longer_than_the_context_is_refused_before_it_touches_the_client(trainer):
    n = trainer.base.max_length + 1
    datum = types.Datum(model_input=types.ModelInput.from_ints([1] * n),
                        loss_fn_inputs={"target_tokens": [1] * n, "weights": [1.0] * n})
    ok = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3],
                                                                                      "weights": [1.0, 1.0]})
    weights = lora_snapshot(trainer)
    message = r"^data\[1\].model_input: 8193 tokens exceed the model's context of 8192 \(max_position_embeddings\)"
    for call in (lambda: trainer.forward_backward([ok, datum], "cross_entropy"),
                 lambda: trainer.forward([ok, datum], "cross_entropy"),
                 lambda: trainer.forward_backward_custom([ok, datum], lambda d, lp: (sum(x.sum() for x in lp), {}))):
        with pytest.raises(ValueError, match=message):
            call()
    assert all(torch.equal(v, weights[k]) for k, v in lora_snapshot(trainer).items())
    assert all(p.grad is None for p in trainer._params)


@pytest.mark.model
def test_a_datum_exactly_the_context_long_trains(trainer, monkeypatch):
    monkeypatch.setattr(trainer.base.model.config, "max_position_embeddings", 8)
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 9))),
                        loss_fn_inputs={"target_tokens": list(range(2, 10)), "weights": [1.0] * 8})
    out = trainer.forward([datum], "cross_entropy").result()
    assert len(out.loss_fn_outputs[0]["logprobs"].data) == 8
    with pytest.raises(ValueError, match="9 tokens exceed the model's context of 8"):
        trainer.forward([types.Datum(model_input=datum.model_input.append_int(9),
                                     loss_fn_inputs={"target_tokens": list(range(2, 11))})], "cross_entropy")


# ------------------------------------------------------------------ data file -> prompt -> engine
@pytest.mark.model
def test_control_characters_in_a_question_reach_the_model_intact(tmp_path, sampler, trainer, tokenizer):
    question = "What is 2 + 2?\x00\x07\x1b[0m\u2028\ufffd\x7f"
    path = write_jsonl(tmp_path, json.dumps({"question": question, "answer": "4"}).encode())
    problem = datasets.load_pool(path)[-1]
    prompt = render_prompt(tokenizer, problem["question"])
    assert question in tokenizer.decode(prompt)  # encoded losslessly
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                            types.SamplingParams(max_tokens=3, temperature=1.0, seed=0)).result()
    for s in result.sequences:
        assert 1 <= len(s.tokens) <= 3 and all(math.isfinite(lp) and lp <= 0 for lp in s.logprobs)
    out = trainer.forward([sft_datum(tokenizer, problem["question"], problem["answer"])], "cross_entropy").result()
    assert all(math.isfinite(lp) for lp in out.loss_fn_outputs[0]["logprobs"].data)


@pytest.mark.model
def test_a_question_too_long_for_the_context_loads_but_its_prompt_is_refused_with_the_lengths(tmp_path, sampler,
                                                                                               trainer, tokenizer):
    """The data layer knows no tokenizer, so it keeps the question; the engine refuses its prompt, untruncated."""
    path = write_jsonl(tmp_path, json.dumps({"question": "word " * 9000, "answer": "1"}).encode())
    problem = datasets.load_pool(path)[-1]
    prompt = render_prompt(tokenizer, problem["question"])
    assert len(prompt) > 8192
    with pytest.raises(ValueError, match=rf"^prompt: {len(prompt)} tokens exceed the model's context of 8192"):
        sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=16))
    sft = sft_datum(tokenizer, problem["question"], problem["answer"])  # what the SFT warm start would train on
    with pytest.raises(ValueError, match=rf"^data\[0\].model_input: {sft.model_input.length} tokens exceed"):
        trainer.forward_backward([sft], "cross_entropy")


@pytest.mark.model
def test_a_run_refuses_problems_too_long_for_the_context_before_it_starts(tmp_path, tokenizer):
    """Drawn hours in, an over-long problem would stop the run, and a resumed run would draw it again."""
    near_limit = json.dumps({"question": "word " * 8000, "answer": "1"}).encode()
    path = write_jsonl(tmp_path, near_limit, *GOOD * 3)  # 13 problems: the long one trains, the last one is held out
    length = len(render_prompt(tokenizer, "word " * 8000))
    check_prompts_fit(EMBEDDED, path, None, 1, "{question}", max_tokens=8192 - length)  # fits exactly
    message = (rf"^dataset: 1 of 12 problems are too long for max_tokens={8193 - length} in .*'s context of 8192 "
               rf"tokens \(longest: problem 'problems-4', {length} prompt tokens; .*\); lower max_tokens to at most "
               rf"{8192 - length} or remove")
    with pytest.raises(ValueError, match=message):
        check_prompts_fit(EMBEDDED, path, None, 1, "{question}", max_tokens=8193 - length)
    train = write_jsonl(tmp_path, *GOOD * 3, name="train.jsonl")
    beyond_context = json.dumps({"question": "word " * 9000, "answer": "1"}).encode()
    held_out = write_jsonl(tmp_path, beyond_context, name="held.jsonl")
    with pytest.raises(ValueError, match=r"^eval_dataset: 1 of 1 problems .*prompt tokens; .*\); shorten or remove "):
        check_prompts_fit(EMBEDDED, train, held_out, 1, "{question}", max_tokens=16)
