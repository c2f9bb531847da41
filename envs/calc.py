"""Calc-v0: arithmetic word problems solved with a ``calculate`` tool (the safe evaluator in ``calculator``).

Tasks come from eight templates with random names and numbers (``generate_tasks``, deterministic in its seed).
Difficulty knobs: ``kinds`` (which templates) and ``max_operand`` (the largest random operand; 9 makes every operand a
single digit, so a small model's warm start only has to copy one token per number).
Reward: ``correct`` = 1 if the answer's number is within 1e-4 relative tolerance of the gold value.
Oracle: one ``calculate`` call with the gold expression, then the result as the answer.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from agentrl.envs.calculator import ExpressionError, evaluate, format_number
from agentrl.envs.errors import ToolError
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import tool
from agentrl.envs.turns import AssistantTurn, ToolCall, answer
from agentrl.reward import numeric_match

if TYPE_CHECKING:
    import datasets

_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena"]
_ITEMS = ["apple", "pencil", "marble", "sticker", "card", "book"]


NUM_KINDS = 8
_MAX_DRAWS = 1000


def _template(rng: random.Random, kinds: Sequence[int], max_operand: int) -> tuple[str, str]:
    """(question, expression) for one random problem."""
    n, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c, d = (rng.randint(2, max_operand) for _ in range(4))
    kind = rng.choice(kinds)
    if kind == 0:
        c = rng.randint(1, a * b)
        return f"{n} buys {a} packs of {b} {item}s and gives away {c}. How many {item}s are left?", f"{a} * {b} - {c}"
    if kind == 1:
        return (f"A train travels at {a} km/h for {b} hours, then at {c} km/h for {d} hours. "
                "How many kilometres does it travel in total?", f"{a} * {b} + {c} * {d}")
    if kind == 2:
        total = a * rng.randint(10, 500)
        return (f"{n} splits {total} dollars equally among {a} friends. How many dollars does each friend get?",
                f"{total} / {a}")
    if kind == 3:
        c = rng.randint(1, min(a, b))
        return (f"A rectangle is {a} m by {b} m. How much larger is its area, in square metres, than the area of "
                f"a square with side {c} m?", f"{a} * {b} - {c} ** 2")
    if kind == 4:
        pct = rng.choice([5, 10, 15, 20, 25, 30, 40, 50])
        return (f"{n} saves {a} dollars a week for {b} weeks and then spends {pct}% of the savings. "
                "How many dollars are left?", f"{a} * {b} * (1 - {pct} / 100)")
    if kind == 5:
        return f"What is the average of {a}, {b}, {c} and {d}?", f"({a} + {b} + {c} + {d}) / 4"
    if kind == 6:
        up, down = rng.choice([10, 20, 25, 50]), rng.choice([10, 20, 25, 50])
        return (f"A price of {a * 4} dollars rises by {up}% and then falls by {down}%. What is the final price "
                "in dollars?", f"{a * 4} * (1 + {up} / 100) * (1 - {down} / 100)")
    return (f"{a} workers each work {b % 12 + 1} hours a day for {c % 30 + 1} days. How many hours do they work "
            "in total?", f"{a} * {b % 12 + 1} * {c % 30 + 1}")


def generate_tasks(num_tasks: int = 1000, seed: int = 0, *, kinds: Sequence[int] | None = None,
                   max_operand: int = 99) -> datasets.Dataset:
    """Columns: id, question, expression (the gold computation), answer (float).

    kinds: the templates to draw from (0..7; None: all); max_operand: the largest random operand (>= 2). Every task's
    expression is distinct, so the last tasks, held out for evaluation, are problems the training tasks never pose.
    """
    import datasets

    if num_tasks <= 0:
        raise ValueError(f"num_tasks must be > 0, got {num_tasks!r}")
    kinds = list(range(NUM_KINDS)) if kinds is None else list(kinds)
    if not kinds or any(not isinstance(k, int) or not 0 <= k < NUM_KINDS for k in kinds):
        raise ValueError(f"kinds={kinds!r} must be a non-empty list of template numbers 0..{NUM_KINDS - 1}")
    if not isinstance(max_operand, int) or max_operand < 2:
        raise ValueError(f"max_operand={max_operand!r} must be an integer >= 2")
    rows, seen = [], set()
    for i in range(num_tasks):
        rng = random.Random(f"calc:{seed}:{i}")
        for _ in range(_MAX_DRAWS):  # a problem already drawn is drawn again: held-out tasks are new problems
            question, expression = _template(rng, kinds, max_operand)
            if expression not in seen:
                break
        else:
            raise ValueError(f"kinds={kinds}, max_operand={max_operand} hold fewer than num_tasks={num_tasks} "
                             "distinct problems")
        seen.add(expression)
        rows.append({"id": f"calc-{seed}-{i}", "question": question, "expression": expression,
                     "answer": float(evaluate(expression))})
    return datasets.Dataset.from_list(rows)


class CalcEnv(ToolEnv):
    """Arithmetic word problems with a calculator."""

    instructions = "Use the calculate tool for arithmetic; answer with just the number."

    def __init__(self, tasks: Any = None, *, num_tasks: int = 1000, task_seed: int = 0, max_turns: int = 8,
                 kinds: Sequence[int] | None = None, max_operand: int = 99, **kwargs: Any) -> None:
        if tasks is None:
            tasks = generate_tasks(num_tasks, task_seed, kinds=kinds, max_operand=max_operand)
        super().__init__(tasks, max_turns=max_turns, **kwargs)

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return the result.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "3 * (4 + 5) / 2"; also pi, e,
                sqrt, abs, round, min, max, floor, ceil, log, exp.
        """
        try:
            return format_number(evaluate(expression))
        except ExpressionError as exc:
            raise ToolError(str(exc)) from None

    def prompt(self, task: Mapping[str, Any]) -> str:
        return task["question"]

    def score(self, task: Mapping[str, Any], answer: str) -> dict[str, float]:
        return {"correct": numeric_match(answer, task["answer"], rel_tol=1e-4)}

    def oracle(self, task: Mapping[str, Any]) -> list[AssistantTurn]:
        return [AssistantTurn(content="I will compute it.",
                              calls=(ToolCall("calculate", {"expression": task["expression"]}),)),
                answer(format_number(evaluate(task["expression"])))]
