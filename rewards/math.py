"""Math reward: extract the final answer from a reply and check it with math-verify.

The answer is the last ``\\boxed{...}``, else the text after the last ``Answer:``,
else the last number in the reply. math-verify then decides equivalence with the
gold answer (12 == 12.0 == \\frac{24}{2}). An optional format bonus rewards replies
that state the answer unambiguously (boxed, after ``Answer:``, or as the whole reply).
"""

from __future__ import annotations

import logging
import re

from math_verify import parse, verify

# Timeouts are signal based (main thread only); rewards may run in worker threads, and inputs are short.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*(.+)", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> tuple[str | None, str]:
    """The final answer in ``text`` and how it was found: 'boxed', 'answer', 'whole', 'last_number' or 'none'."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip(), "boxed"
    matches = _ANSWER.findall(text)
    if matches:
        numbers = _NUMBER.findall(matches[-1])
        return (numbers[0].replace(",", "") if numbers else matches[-1].strip()), "answer"
    stripped = text.strip().rstrip(".")
    if _NUMBER.fullmatch(stripped):
        return stripped.replace(",", ""), "whole"
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(",", ""), "last_number"
    return None, "none"


def is_correct(answer: str | None, gold: str) -> bool:
    if answer is None:
        return False
    if answer == gold:
        return True
    return bool(verify(parse(f"${gold}$", parsing_timeout=None), parse(f"${answer}$", parsing_timeout=None),
                       timeout_seconds=None))


def math_reward(completion: str, example: dict, format_bonus: float = 0.0) -> float:
    """1 for a correct final answer (plus ``format_bonus`` if stated unambiguously), else 0."""
    answer, how = extract_answer(completion)
    score = float(is_correct(answer, str(example["answer"])))
    if format_bonus and how in ("boxed", "answer", "whole"):
        score += format_bonus
    return score


math_reward.shaping_options = ("format_bonus",)  # evaluation leaves these out of accuracy


def last_integer_reward(completion: str, example: dict) -> float:
    """1 if the last integer in the reply equals the answer: the reference job's reward (issue 4)."""
    numbers = re.findall(r"-?\d+", completion)
    return float(bool(numbers) and numbers[-1] == str(example["answer"]).strip())
