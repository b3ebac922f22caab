"""Judge-model rewards for chat RL: a language model grades the replies with a rubric.

Two modes:
- ``score`` (pointwise): the judge rates each reply 1-9; reward = (rating - 1) / 8.
- ``pairwise``: the judge compares every two replies of a group, in both orders (so a
  judge that prefers whatever comes first gains nothing); a reply's reward is its win rate
  against the rest of its group (a tie or an unreadable verdict counts half). A group of
  one reply (evaluation) is graded pointwise.

Two backends:
- ``local``: a model run in this process by the mint engine (the embedded model by default,
  or any local/hub model), loaded once and kept warm. Its verdict is read from the
  probabilities of the grading tokens as the first token of its reply (``grading:
  probability``, the default: P(A) / (P(A) + P(B)), or the expected rating over 1..9), which
  a small model gives even when it would not write a clean verdict; ``grading: text``
  reads its greedy reply instead, as for an HTTP judge.
- ``http``: any OpenAI-compatible chat-completions endpoint (vLLM, TGI, a hosted API), given
  by ``url`` and ``judge_model``, its key read from the environment variable named by
  ``api_key_env``; each call has a timeout, is retried with exponential backoff on timeouts,
  5xx and malformed replies, and at most ``concurrency`` calls are in flight.

A text verdict without a readable rating or choice counts as the middle of the scale (0.5):
a judge may ramble, and one unreadable verdict must not stop a run. A broken endpoint does stop it,
with a JudgeError naming the URL and the last failure, after the retries.

Prompts may carry IFEval-style ``constraints`` (see ``check_constraints``); then reward =
``(1 - constraint_weight) * judge + constraint_weight * fraction of constraints met``.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import permutations

SYSTEM = "You are a careful, impartial judge of AI assistant replies."
POINTWISE = ("[Question]\n{question}\n\n[The Start of the Reply]\n{reply}\n[The End of the Reply]\n\n"
             "Rate the reply for helpfulness, relevance, accuracy and clarity on a scale of 1 to 9. "
             "Answer with just the number.")
PAIRWISE = ("[Question]\n{question}\n\n[The Start of Reply A]\n{a}\n[The End of Reply A]\n\n"
            "[The Start of Reply B]\n{b}\n[The End of Reply B]\n\n"
            "Which reply answers the question better? Answer with just the letter A or B.")
_RATING = re.compile(r"\b([1-9])\b")
RATINGS = [str(r) for r in range(1, 10)]
_CHOICE = re.compile(r"\b([AB])\b")


def judge_messages(prompt: str) -> list[dict]:
    """The chat every judge backend is asked: the judge's system line, then the rubric prompt."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


class JudgeError(RuntimeError):
    """The judge could not be reached or kept answering with something unusable."""


# ------------------------------------------------------------------ backends
class TextJudge:
    """Verdicts read from the judge's text replies (``complete``)."""

    def complete(self, prompts: Sequence[str]) -> list[str]:
        raise NotImplementedError

    def rate(self, prompts: Sequence[str]) -> list[float]:
        """Each POINTWISE prompt's rating, scaled to 0-1."""
        return [parse_rating(v) for v in self.complete(prompts)]

    def prefer(self, prompts: Sequence[str]) -> list[float]:
        """For each PAIRWISE prompt, how much the judge prefers reply A (1 A, 0 B, 0.5 unsure)."""
        return [{"A": 1.0, "B": 0.0}.get(parse_choice(v), 0.5) for v in self.complete(prompts)]


class LocalJudge(TextJudge):
    """A judge model run by the mint engine in this process; greedy verdicts, batched."""

    def __init__(self, model: str, max_tokens: int = 8, grading: str = "probability"):
        if grading not in ("probability", "text"):
            raise ValueError(f"judge: grading {grading!r}; expected 'probability' or 'text'")
        self.model, self.max_tokens, self.grading = model, max_tokens, grading

    def rate(self, prompts: Sequence[str]) -> list[float]:
        if self.grading == "text":
            return super().rate(prompts)
        return [sum(p * r for p, r in zip(probs, range(9))) / 8 for probs in self._choice_probabilities(prompts,
                                                                                                       RATINGS)]

    def prefer(self, prompts: Sequence[str]) -> list[float]:
        if self.grading == "text":
            return super().prefer(prompts)
        return [probs[0] for probs in self._choice_probabilities(prompts, ["A", "B"])]

    def _choice_probabilities(self, prompts: Sequence[str], choices: list[str]) -> list[list[float]]:
        """P(choice | prompt) as the first token of the judge's reply, renormalized over ``choices``."""
        import math


        tokenizer = self._sampler.get_tokenizer()
        ids = [tokenizer.encode(c, add_special_tokens=False)[0] for c in choices]
        futures = [self._sampler.next_token_logprobs(self._tokens(judge_messages(p)), ids) for p in prompts]
        out = []
        for future in futures:
            weights = [math.exp(lp) for lp in future.result()]
            out.append([w / sum(weights) for w in weights])
        return out

    def _tokens(self, messages: list[dict]):
        from mint import types

        return types.ModelInput.from_ints(self._sampler.get_tokenizer().apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False))

    @functools.cached_property
    def _sampler(self):
        import mint

        return mint.ServiceClient().create_sampling_client(base_model=self.model)

    def complete(self, prompts: Sequence[str]) -> list[str]:
        return self.chat([judge_messages(p) for p in prompts])

    def chat(self, conversations: Sequence[list[dict]], max_tokens: int | None = None) -> list[str]:
        """Greedy replies to chat conversations, all in one batch."""
        from mint import types

        tokenizer = self._sampler.get_tokenizer()
        greedy = types.SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=0.0)
        futures = [self._sampler.sample(self._tokens(messages), 1, greedy) for messages in conversations]
        return [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]


class HttpJudge(TextJudge):
    """An OpenAI-compatible ``/chat/completions`` endpoint."""

    def __init__(self, url: str, model: str, api_key_env: str = "MINTFLOW_JUDGE_API_KEY", timeout: float = 30.0,
                 max_retries: int = 4, backoff: float = 1.0, concurrency: int = 4, max_tokens: int = 8):
        self.url = url.rstrip("/") + "/chat/completions"
        self.model, self.timeout, self.backoff = model, float(timeout), float(backoff)
        self.max_retries, self.max_tokens = int(max_retries), int(max_tokens)
        self.api_key = os.environ.get(api_key_env, "")
        self._pool = ThreadPoolExecutor(max_workers=int(concurrency), thread_name_prefix="judge")

    def complete(self, prompts: Sequence[str]) -> list[str]:
        return list(self._pool.map(self._complete_one, prompts))

    def _complete_one(self, prompt: str) -> str:
        import httpx

        body = {"model": self.model, "temperature": 0.0, "max_tokens": self.max_tokens,
                "messages": judge_messages(prompt)}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        failure = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = httpx.post(self.url, json=body, headers=headers, timeout=self.timeout)
            except httpx.HTTPError as e:  # timeouts, refused connections, broken streams
                failure = f"{type(e).__name__}: {e}"
                continue
            if response.status_code >= 500 or response.status_code == 429:
                failure = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:  # our request is wrong: retrying cannot help
                raise JudgeError(f"judge {self.url}: HTTP {response.status_code}: {response.text[:300]}")
            try:
                return str(response.json()["choices"][0]["message"]["content"])
            except (ValueError, KeyError, IndexError, TypeError):
                failure = f"not a chat completion: {response.text[:200]!r}"
        raise JudgeError(f"judge {self.url}: no usable reply after {self.max_retries + 1} attempts; "
                         f"last failure: {failure}")


_judges: dict[tuple, LocalJudge | HttpJudge] = {}
_judges_lock = threading.Lock()


def get_judge(backend: str = "local", judge_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct", url: str = "",
              grading: str = "probability", **http_options) -> LocalJudge | HttpJudge:
    """One judge per configuration and process, kept warm across calls."""
    key = (backend, judge_model, url, grading, tuple(sorted(http_options.items())))
    with _judges_lock:
        if key not in _judges:
            if backend == "local":
                _judges[key] = LocalJudge(judge_model, grading=grading)
            elif backend == "http":
                if not url:
                    raise ValueError("judge: backend 'http' needs reward_options.url (e.g. http://127.0.0.1:8000/v1)")
                _judges[key] = HttpJudge(url, judge_model, **http_options)
            else:
                raise ValueError(f"judge: backend {backend!r}; expected 'local' or 'http'")
        return _judges[key]


# ------------------------------------------------------------------ verdicts
def parse_rating(verdict: str) -> float:
    """(rating - 1) / 8 for the first rating 1-9 in the verdict; 0.5 when there is none."""
    match = _RATING.search(verdict)
    return (int(match.group(1)) - 1) / 8 if match else 0.5


def parse_choice(verdict: str) -> str | None:
    """'A' or 'B' (the first standalone letter), else None."""
    match = _CHOICE.search(verdict.strip().upper())
    return match.group(1) if match else None


def pointwise_scores(judge, question: str, replies: Sequence[str]) -> list[float]:
    return judge.rate([POINTWISE.format(question=question, reply=r) for r in replies])


def pairwise_win_rates(judge, question: str, replies: Sequence[str]) -> list[float]:
    """Each reply's win rate against the others, every pair judged in both orders."""
    if len(replies) < 2:
        return pointwise_scores(judge, question, replies)
    ordered = list(permutations(range(len(replies)), 2))  # (i, j) shows i as A, j as B; (j, i) swaps them
    preferences = judge.prefer([PAIRWISE.format(question=question, a=replies[i], b=replies[j]) for i, j in ordered])
    wins = [0.0] * len(replies)
    for (i, j), a_wins in zip(ordered, preferences):
        wins[i] += a_wins
        wins[j] += 1.0 - a_wins
    comparisons = 2 * (len(replies) - 1)  # each reply meets each other reply twice
    return [w / comparisons for w in wins]


# ------------------------------------------------------------------ constraints
def check_constraints(reply: str, constraints: Sequence[dict]) -> float:
    """Fraction of IFEval-style constraints the reply meets (1.0 when there are none)."""
    if not constraints:
        return 1.0
    met = 0
    for c in constraints:
        kind, value = c["kind"], c.get("value")
        if kind == "max_words":
            met += len(reply.split()) <= int(value)
        elif kind == "min_words":
            met += len(reply.split()) >= int(value)
        elif kind == "include_word":
            met += re.search(rf"\b{re.escape(str(value))}\b", reply, re.IGNORECASE) is not None
        elif kind == "no_commas":
            met += "," not in reply
        elif kind == "lowercase":
            met += reply == reply.lower() and any(ch.isalpha() for ch in reply)
        elif kind == "end_with":
            met += reply.strip().endswith(str(value))
        else:
            raise ValueError(f"judge: unknown constraint kind {kind!r} in a problem's 'constraints'")
    return met / len(constraints)


# ------------------------------------------------------------------ the reward
def judge_group_reward(completions: Sequence[str], problem: dict, mode: str = "score", backend: str = "local",
                       judge_model: str = "HuggingFaceTB/SmolLM2-135M-Instruct", url: str = "",
                       grading: str = "probability", constraint_weight: float = 0.5,
                       **http_options) -> list[float]:
    """Rewards for one group of replies to ``problem['question']``."""
    if mode not in ("score", "pairwise"):
        raise ValueError(f"judge: mode {mode!r}; expected 'score' or 'pairwise'")
    if not 0.0 <= constraint_weight <= 1.0:
        raise ValueError(f"judge: constraint_weight {constraint_weight} must be within [0, 1]")
    judge = get_judge(backend, judge_model, url, grading, **http_options)
    grade = pairwise_win_rates if mode == "pairwise" else pointwise_scores
    scores = grade(judge, problem["question"], completions)
    constraints = problem.get("constraints") or []
    if not constraints:
        return scores
    return [(1 - constraint_weight) * s + constraint_weight * check_constraints(reply, constraints)
            for s, reply in zip(scores, completions)]


judge_group_reward.group_reward = True  # scores a whole group at once (see rewards.score_group)
