"""Judge rewards: verdict parsing, pairwise win rates free of position bias, constraint checks,
the in-process judge, and the OpenAI-compatible HTTP judge against real servers on 127.0.0.1:
one that serves the in-process judge, and broken ones (slow, garbage, failing then fine)."""

import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import free_port

from rewards.judge import (
    HttpJudge,
    JudgeError,
    LocalJudge,
    TextJudge,
    check_constraints,
    judge_group_reward,
    pairwise_win_rates,
    parse_choice,
    parse_rating,
)

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ScriptedJudge(TextJudge):
    """A judge whose verdict is a function of the prompt (for the arithmetic of win rates)."""

    def __init__(self, verdict):
        self.verdict, self.prompts = verdict, []

    def complete(self, prompts):
        self.prompts += prompts
        return [self.verdict(p) for p in prompts]


def _reply(prompt: str, which: str) -> str:
    return prompt.split(f"[The Start of Reply {which}]\n")[1].split(f"\n[The End of Reply {which}]")[0]


def test_ratings_and_choices_are_read_from_the_verdict():
    assert parse_rating("8") == pytest.approx(7 / 8)
    assert parse_rating("Rating: 9/9") == 1.0
    assert parse_rating("1") == 0.0
    assert parse_rating("I cannot rate this.") == 0.5  # unreadable: the middle of the scale
    assert parse_choice("B") == "B" and parse_choice("Reply A is better") == "A"
    assert parse_choice("Both are fine") is None


def test_a_judge_that_always_picks_the_first_reply_gives_everyone_the_same_reward():
    judge = ScriptedJudge(lambda prompt: "A")
    assert pairwise_win_rates(judge, "q", ["short", "a longer reply", "the longest reply of all"]) == [0.5] * 3
    assert len(judge.prompts) == 6  # every pair, both orders


def test_pairwise_rewards_are_win_rates_within_the_group():
    longer = ScriptedJudge(lambda p: "A" if len(_reply(p, "A")) > len(_reply(p, "B")) else "B")
    assert pairwise_win_rates(longer, "q", ["aa", "a", "aaa"]) == [0.5, 0.0, 1.0]
    unsure = ScriptedJudge(lambda p: "hmm")
    assert pairwise_win_rates(unsure, "q", ["x", "y"]) == [0.5, 0.5]


def test_a_single_reply_is_graded_pointwise():
    judge = ScriptedJudge(lambda p: "7")
    assert pairwise_win_rates(judge, "q", ["only"]) == [pytest.approx(6 / 8)]


def test_constraints_are_checked_and_mixed_into_the_reward():
    assert check_constraints("one two three", [{"kind": "max_words", "value": 3}]) == 1.0
    assert check_constraints("hello, world", [{"kind": "no_commas"}, {"kind": "lowercase"}]) == 0.5
    assert check_constraints("This is it. Any other questions?",
                             [{"kind": "end_with", "value": "Any other questions?"},
                              {"kind": "include_word", "value": "because"}]) == 0.5
    with pytest.raises(ValueError, match="unknown constraint kind 'rhyme'"):
        check_constraints("x", [{"kind": "rhyme"}])


@pytest.mark.model
def test_the_local_judge_grades_a_group_in_one_batch():
    problem = {"id": "q", "question": "What is the capital of France?",
               "constraints": [{"kind": "max_words", "value": 5}]}
    replies = ["Paris.", "The capital of France is Paris, a city on the Seine known for the Eiffel Tower."]
    rewards = judge_group_reward(replies, problem, mode="score", judge_model=EMBEDDED, constraint_weight=0.5)
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    assert rewards[0] >= 0.5 and rewards[1] <= 0.5  # the constraint half: met by the first only
    pairwise = judge_group_reward(replies, {"id": "q", "question": problem["question"]}, mode="pairwise",
                                  judge_model=EMBEDDED)
    assert sum(pairwise) == pytest.approx(1.0)  # two replies: the win rates split the comparisons
    assert len(set(pairwise)) == 2  # probabilities: never an exact tie


@pytest.mark.model
def test_the_local_judges_probabilities_prefer_a_right_answer_over_a_wrong_one():
    question = "What is the capital of France?"
    judge = LocalJudge(EMBEDDED)
    right, wrong = pairwise_win_rates(judge, question, ["The capital of France is Paris.",
                                                        "The capital of France is Berlin."])
    assert right > wrong
    assert LocalJudge(EMBEDDED, grading="text").rate(["x"])[0] in [i / 8 for i in range(9)] + [0.5]


# ---------------------------------------------------------------- HTTP
def _wait_for(port: int, process=None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited: {process.stdout.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listening on {port}")


@contextmanager
def _server(app):
    """A uvicorn server for ``app`` on a free loopback port, in a thread."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_for(port)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


def _broken_app(behaviour: str, calls: list):
    from fastapi import FastAPI, Response

    app = FastAPI()

    @app.post("/v1/chat/completions")
    def complete(body: dict):
        calls.append(body)
        if behaviour == "slow":
            time.sleep(2)
        if behaviour == "garbage":
            return Response("<html>502 upstream</html>", media_type="text/html")
        if behaviour == "flaky" and len(calls) < 3:
            return Response("overloaded", status_code=503)
        return {"choices": [{"message": {"role": "assistant", "content": "9"}}]}

    return app


@pytest.mark.parametrize("behaviour, message", [("slow", "ReadTimeout"), ("garbage", "not a chat completion")])
def test_a_broken_endpoint_is_retried_then_fails_clearly(behaviour, message):
    calls = []
    with _server(_broken_app(behaviour, calls)) as url:
        judge = HttpJudge(url, "judge", timeout=0.5, max_retries=2, backoff=0.05)
        with pytest.raises(JudgeError, match=message) as error:
            judge.complete(["rate this"])
    assert url in str(error.value) and "3 attempts" in str(error.value)
    assert len(calls) == 3


def test_a_flaky_endpoint_is_retried_until_it_answers(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "secret-key")
    calls = []
    with _server(_broken_app("flaky", calls)) as url:
        judge = HttpJudge(url, "judge", api_key_env="MY_JUDGE_KEY", max_retries=3, backoff=0.05, concurrency=2)
        assert judge.complete(["a", "b"]) == ["9", "9"]
    assert len(calls) >= 3 and calls[0]["model"] == "judge" and calls[0]["temperature"] == 0.0


@pytest.mark.model
def test_the_http_judge_on_the_served_local_judge_matches_the_local_judge():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "judge-serve", "--model", EMBEDDED, "--port",
                               str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(port, server)
        prompts = ["[Question]\nWhat is 2 + 2?\n\n[The Start of the Reply]\n4\n[The End of the Reply]\n\n"
                   "Rate the reply on a scale of 1 to 10. Answer with just the number.",
                   "Which is larger, 3 or 5? Answer with just the number."]
        remote = HttpJudge(f"http://127.0.0.1:{port}/v1", EMBEDDED, concurrency=2).complete(prompts)
        assert remote == LocalJudge(EMBEDDED).complete(prompts)  # greedy on both sides: the same verdicts
    finally:
        server.terminate()
        server.wait(30)
