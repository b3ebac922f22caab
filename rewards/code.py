"""Code reward: run the completion's code against the problem's tests in the sandbox.

A code problem is ``{"id", "question", "answer", "tests", "entry_point"}`` plus, for
HumanEval-style problems, ``"prompt_code"`` (the signature and docstring the solution
continues). ``answer`` is a reference solution, ``tests`` a list of Python snippets (asserts)
run one by one after the solution. Reward = fraction of tests passed (or all-or-nothing).

The tests run in the same interpreter as the solution, after it; a solution written to
defeat the harness (reading the per-run marker from its caller's frame) could fake passes.
The sandbox bounds what it can do to the host, not what it can claim about itself.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from rewards.sandbox import DEFAULT_LIMITS, Execution, Limits, run_program

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)

_HARNESS = '''\
import sys
_MARK = {mark!r}
_TESTS = {tests!r}
_namespace = {{"__name__": "__solution__"}}
try:
    exec(compile({solution!r}, "solution.py", "exec"), _namespace)
except BaseException as _error:
    print(_MARK, "solution-error", type(_error).__name__, flush=True)
    raise SystemExit(1)
for _index, _test in enumerate(_TESTS):
    try:
        exec(compile(_test, f"test_{{_index}}.py", "exec"), _namespace)
    except BaseException:
        continue
    print(_MARK, "pass", _index, flush=True)
'''


@dataclass(frozen=True)
class Outcome:
    passed: int
    total: int
    execution: Execution

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_code(completion: str, problem: dict | None = None) -> str:
    """The code in a reply: its fenced block that defines the entry point (else the last one), else the reply.

    A HumanEval-style reply that only continues the function body gets the problem's
    ``prompt_code`` in front of it.
    """
    blocks = _FENCED.findall(completion)
    entry = (problem or {}).get("entry_point")
    code = completion
    if blocks:
        defining = [b for b in blocks if entry and f"def {entry}" in b]
        code = (defining or blocks)[-1]
    if problem and problem.get("prompt_code") and entry and f"def {entry}" not in code:
        code = problem["prompt_code"] + code
    return code


def run_tests(solution: str, tests: list[str], limits: Limits = DEFAULT_LIMITS) -> Outcome:
    """Run ``solution`` then each test in one sandboxed program; count the tests that passed."""
    mark = secrets.token_hex(16)
    execution = run_program(_HARNESS.format(mark=mark, tests=list(tests), solution=solution), limits=limits)
    passed = set()
    for line in execution.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == mark and parts[1] == "pass" and parts[2].isdigit():
            passed.add(int(parts[2]))
    return Outcome(passed=len(passed & set(range(len(tests)))), total=len(tests), execution=execution)


def code_reward(completion: str, problem: dict, all_or_nothing: bool = False, cpu_seconds: int = 5,
                wall_seconds: float = 10.0, memory_mb: int = 512) -> float:
    """Fraction of the problem's tests the completion's code passes (1/0 with ``all_or_nothing``)."""
    if not problem.get("tests"):
        raise ValueError(f"code reward: problem {problem.get('id')!r} has no 'tests'; a code dataset "
                         "(python_functions, humaneval or a .jsonl with a 'tests' list) is needed")
    limits = Limits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_mb=memory_mb)
    result = run_tests(extract_code(completion, problem), problem["tests"], limits)
    if all_or_nothing:
        return float(result.passed == result.total)
    return result.fraction
