"""PythonExec-v0: write a function that passes hidden unit tests, trying code out with a sandboxed ``run_python``.

Tasks come from ten parameterised templates (``generate_tasks``); each row holds the prompt, the function name, the
gold solution and hidden tests (inputs and expected outputs computed from the gold solution at generation time).
The final answer is the function's source (a fenced code block is fine). Scoring runs the answer against the hidden
tests in the sandbox:

* ``correct`` (weight 1) = 1 if every test passes; ``tests_passed`` (weight 0: logged, not rewarded) = the fraction.
* A sandbox that fails (not the code in it) makes the episode "failed" with boundary "sandbox".

Known limit: the tests run in the same sandboxed process as the answer, so an answer that inspects the harness could
forge its report (the report line carries a per-run random marker, and a task set loaded from a path is hidden from
the sandbox, but the harness is in the same process). The sandbox contains the damage, not the reward hack.

Oracle: run the gold solution on the first test input with ``run_python``, then answer with it.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
from typing import TYPE_CHECKING, Any, Callable, Mapping

from agentrl.envs.sandbox import Sandbox, SandboxLimits
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import tool
from agentrl.envs.turns import AssistantTurn, ToolCall, answer
from agentrl.reward import unit_tests_passed

if TYPE_CHECKING:
    import datasets

Template = Callable[[random.Random], tuple[str, str, str, Callable[[random.Random], list[Any]]]]


def _ints(rng: random.Random, lo: int = -50, hi: int = 50, n: tuple[int, int] = (0, 12)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghij klmnopqrstuvwxyzAEIOU,!") for _ in range(rng.randint(0, 24)))


def _templates() -> list[Template]:
    """Each returns (function name, task description, gold source, input generator)."""
    def sum_above(r):
        k = r.randint(-5, 20)
        return ("sum_above", f"returns the sum of the elements of the list of ints `xs` that are greater than {k}",
                f"def sum_above(xs):\n    return sum(x for x in xs if x > {k})\n", lambda g: [_ints(g)])

    def count_chars(r):
        chars = "".join(sorted(r.sample("aeioulnrst", 3)))
        return ("count_chars", f"returns how many characters of the string `s` are one of {chars!r} "
                "(case-insensitive)",
                f"def count_chars(s):\n    return sum(c in {chars!r} for c in s.lower())\n", lambda g: [_word(g)])

    def rotate(r):
        k = r.randint(1, 5)
        return ("rotate", f"returns the list `xs` rotated left by {k} positions (wrapping around; [] stays [])",
                f"def rotate(xs):\n    if not xs:\n        return []\n    k = {k} % len(xs)\n"
                "    return xs[k:] + xs[:k]\n",
                lambda g: [_ints(g)])

    def fib_mod(r):
        m = r.choice([7, 10, 97, 1000, 1009])
        return ("fib_mod", f"returns the n-th Fibonacci number modulo {m}, with fib_mod(0) == 0 and fib_mod(1) == 1",
                f"def fib_mod(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {m}\n"
                "    return a\n", lambda g: [g.randint(0, 300)])

    def caesar(r):
        k = r.randint(1, 25)
        return ("caesar", f"shifts every lowercase letter a-z of the string `s` forward by {k} in the alphabet "
                "(wrapping z to a) and leaves other characters unchanged",
                f"def caesar(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c "
                "for c in s)\n", lambda g: [_word(g)])

    def running_max(r):
        return ("running_max", "returns the list whose i-th element is the maximum of `xs[:i+1]`",
                "def running_max(xs):\n    out = []\n    for x in xs:\n        out.append(x if not out else "
                "max(out[-1], x))\n    return out\n", lambda g: [_ints(g)])

    def dedupe(r):
        return ("dedupe", "returns the list `xs` without repeated elements, keeping the first occurrence of each, "
                "in order", "def dedupe(xs):\n    seen = set()\n    return [x for x in xs if not (x in seen or "
                "seen.add(x))]\n", lambda g: [_ints(g, 0, 6)])

    def digit_power_sum(r):
        p = r.randint(2, 4)
        return ("digit_power_sum", f"returns the sum of the decimal digits of the non-negative int `n`, each raised "
                f"to the power {p}", f"def digit_power_sum(n):\n    return sum(int(d) ** {p} for d in str(n))\n",
                lambda g: [g.randint(0, 10 ** 9)])

    def is_palindrome(r):
        return ("is_palindrome", "returns True if the string `s` reads the same backwards when only its letters "
                "and digits are kept and case is ignored, else False",
                "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
                lambda g: [g.choice([_word(g), "Abba", "No lemon, no melon", "ab,A"])])

    def chunk_sums(r):
        k = r.randint(2, 4)
        return ("chunk_sums", f"returns the sums of consecutive chunks of {k} elements of `xs` (the last chunk may "
                "be shorter)",
                f"def chunk_sums(xs):\n    return [sum(xs[i:i + {k}]) for i in range(0, len(xs), {k})]\n",
                lambda g: [_ints(g)])

    return [sum_above, count_chars, rotate, fib_mod, caesar, running_max, dedupe, digit_power_sum, is_palindrome,
            chunk_sums]


def generate_tasks(num_tasks: int = 500, seed: int = 0, *, num_tests: int = 8) -> datasets.Dataset:
    """Columns: id, function, description, gold_code, tests (JSON list of [args, expected])."""
    import datasets

    if num_tasks <= 0 or num_tests <= 0:
        raise ValueError(f"need num_tasks > 0 and num_tests > 0, got {num_tasks!r}, {num_tests!r}")
    templates, rows = _templates(), []
    for i in range(num_tasks):
        rng = random.Random(f"pyexec:{seed}:{i}")
        name, description, gold, inputs = rng.choice(templates)(rng)
        namespace: dict[str, Any] = {}
        exec(gold, namespace)  # our own template code, never model output: that only runs in the sandbox
        tests = []
        for _ in range(num_tests):
            args = inputs(rng)
            tests.append([args, json.loads(json.dumps(namespace[name](*args)))])
        rows.append({"id": f"pyexec-{seed}-{i}", "function": name, "description": description, "gold_code": gold,
                     "tests": json.dumps(tests)})
    return datasets.Dataset.from_list(rows)


_HARNESS = """\
import json, os, sys
REPORT = {marker!r}
TESTS = json.loads({tests!r})
passed = 0
sys.stdout = open(os.devnull, "w")  # the answer's prints must not push the report past the output limit
try:
    namespace = {{"__name__": "solution"}}
    with open("solution.py", encoding="utf-8") as f:
        exec(compile(f.read(), "solution.py", "exec"), namespace)
    function = namespace[{function!r}]
    for args, expected in TESTS:
        try:
            got = function(*json.loads(json.dumps(args)))
            passed += json.loads(json.dumps(got)) == expected
        except Exception:
            pass
except BaseException:
    pass
sys.stdout = sys.__stdout__
print(REPORT + json.dumps({{"passed": passed}}), flush=True)
"""


def extract_code(answer: str) -> str:
    """The code in an answer: the first fenced block if there is one, else the whole text."""
    match = re.search(r"```(?:python|py)?[ \t]*\n(.*?)```", answer, flags=re.S)
    return match.group(1) if match else answer


class PythonExecEnv(ToolEnv):
    """Write a Python function that passes hidden tests."""

    instructions = ("Only the Python standard library is available in run_python. Give the final answer as the "
                    "complete function source.")
    reward_weights = {"correct": 1.0, "tests_passed": 0.0}

    def __init__(self, tasks: Any = None, *, num_tasks: int = 500, task_seed: int = 0,
                 limits: SandboxLimits | None = None, isolation: str = "auto", max_turns: int = 8,
                 **kwargs: Any) -> None:
        super().__init__(generate_tasks(num_tasks, task_seed) if tasks is None else tasks, max_turns=max_turns,
                         **kwargs)
        # A task set loaded from disk holds the hidden tests: hide it from the code, as well as the home dirs.
        hidden = ["/root", "/home", *([os.path.abspath(tasks)] if isinstance(tasks, str) else [])]
        self.sandbox = Sandbox(limits or SandboxLimits(wall_s=10.0, cpu_s=5.0), isolation=isolation,
                               hidden_paths=hidden)

    @tool
    def run_python(self, code: str) -> str:
        """Run a Python program in a sandbox and return its exit status, stdout and stderr.

        Args:
            code: the program's source; print what you want to see. No network; files live only for this run.
        """
        result = self.sandbox.run(code)
        lines = [f"outcome: {result.outcome} (exit code {result.returncode})"]
        for name, text, cut in (("stdout", result.stdout, result.stdout_truncated),
                                ("stderr", result.stderr, result.stderr_truncated)):
            if text or cut:
                lines.append(f"{name}:\n{text}" + ("\n[truncated]" if cut else ""))
        return "\n".join(lines)

    def prompt(self, task: Mapping[str, Any]) -> str:
        return f"Write a Python function `{task['function']}` that {task['description']}."

    def score(self, task: Mapping[str, Any], answer: str) -> dict[str, float]:
        marker = f"@@agentrl-tests-{secrets.token_hex(8)}@@"
        harness = _HARNESS.format(marker=marker, tests=task["tests"], function=task["function"])
        result = self.sandbox.run(harness, files={"solution.py": extract_code(answer)})
        total = len(json.loads(task["tests"]))
        reports = [line[len(marker):] for line in result.stdout.splitlines() if line.startswith(marker)]
        passed = int(json.loads(reports[-1])["passed"]) if reports else 0  # no report: crashed or timed out
        fraction = unit_tests_passed(min(max(passed, 0), total), total)
        return {"correct": float(fraction == 1.0), "tests_passed": fraction}

    def oracle(self, task: Mapping[str, Any]) -> list[AssistantTurn]:
        args = json.loads(task["tests"])[0][0]
        trial = f"{task['gold_code']}\nprint({task['function']}(*{args!r}))\n"
        return [AssistantTurn(content="Let me try it.", calls=(ToolCall("run_python", {"code": trial}),)),
                answer(f"```python\n{task['gold_code']}```")]
