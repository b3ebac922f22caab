"""Problems with verifiable answers: ``{"id", "question", "answer"}`` dicts.

- ``arithmetic``: generated a + b with a, b in 0..20 (the embedded CPU default);
- ``gsm8k`` / ``math``: the hub datasets through ``datasets.load_dataset`` (hub or local HF cache);
- a ``.jsonl`` path: one ``{"question", "answer"}`` object per line.
Training problems are drawn per iteration from a derived seed; the eval set is fixed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ARITHMETIC_PROMPT = "What is {a} + {b}? Answer with just the number."
EVAL_SEED = 1_000_003


ARITHMETIC_HELD_OUT = 100  # of the 441 pairs (a, b) in 0..20, these never appear in training


def _addition(a: int, b: int) -> dict:
    return {"id": f"add-{a}-{b}", "question": ARITHMETIC_PROMPT.format(a=a, b=b), "answer": str(a + b)}


def _arithmetic_split() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(21) for b in range(21)]
    random.Random(EVAL_SEED).shuffle(pairs)
    return pairs[ARITHMETIC_HELD_OUT:], pairs[:ARITHMETIC_HELD_OUT]


def arithmetic(n: int, seed: int) -> list[dict]:
    """``n`` training additions drawn (with replacement) from the pairs outside the held-out set."""
    train, _ = _arithmetic_split()
    rng = random.Random(seed)
    return [_addition(*train[rng.randrange(len(train))]) for _ in range(n)]


HUB_DATASETS = {"gsm8k": ("openai/gsm8k", "main", "train"), "math": ("HuggingFaceH4/MATH-500", None, "test")}


def _hub(name: str) -> list[dict]:
    from datasets import load_dataset

    repo, subset, split = HUB_DATASETS[name]
    try:
        rows = load_dataset(repo, subset, split=split)
    except Exception as e:  # offline and not in the local HF cache, most often
        raise ValueError(f"dataset: could not load {repo!r} from the hub or the local HF cache "
                         f"({type(e).__name__}: {str(e)[:200]}); offline, pass a .jsonl path instead") from None
    if name == "gsm8k":
        return [{"id": f"gsm8k-{i}", "question": r["question"], "answer": r["answer"].split("####")[-1].strip()}
                for i, r in enumerate(rows)]
    return [{"id": f"math-{i}", "question": r["problem"], "answer": r["answer"]} for i, r in enumerate(rows)]


def _jsonl(path: Path) -> list[dict]:
    problems = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"dataset {path}:{line_no}: each line needs 'question' and 'answer'")
            problems.append({"id": str(row.get("id", f"{path.stem}-{line_no}")), "question": row["question"],
                             "answer": str(row["answer"])})
    return problems


def load_pool(dataset: str) -> list[dict] | None:
    """All problems of a finite dataset, or None for a generator."""
    if dataset == "arithmetic":
        return None
    if dataset in HUB_DATASETS:
        return _hub(dataset)
    path = Path(dataset).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        return _jsonl(path)
    raise ValueError(f"dataset: unknown dataset {dataset!r}; expected 'arithmetic', 'gsm8k', 'math' or a .jsonl file")


def _split(pool: list[dict]) -> tuple[list[dict], list[dict]]:
    """A fixed held-out tail (10%, at most 500) that training never draws from."""
    held_out = max(1, min(500, len(pool) // 10))
    if len(pool) < 2:
        raise ValueError(f"dataset: {len(pool)} problems; need at least 2 to hold one out for evaluation")
    return pool[:-held_out], pool[-held_out:]


def train_batch(dataset: str, n: int, seed: int) -> list[dict]:
    pool = load_pool(dataset)
    if pool is None:
        return arithmetic(n, seed)
    train, _ = _split(pool)
    rng = random.Random(seed)
    return [train[rng.randrange(len(train))] for _ in range(n)]


def eval_set(dataset: str, n: int) -> list[dict]:
    pool = load_pool(dataset)
    if pool is None:
        if n > ARITHMETIC_HELD_OUT:
            raise ValueError(f"eval_size: {n} exceeds the {ARITHMETIC_HELD_OUT} held-out arithmetic problems")
        return [_addition(a, b) for a, b in _arithmetic_split()[1][:n]]
    return _split(pool)[1][:n]
