"""Envs that fail the ways tools fail in the wild, for the rollout layer's fault tests (and scripts/chaos.py).

`tests/Fault-v0`: task i asks the policy to call `probe(what=KINDS[i % len(KINDS)])`, then answer "done". The probe
returns normally (`ok`), raises (`raise`), sleeps for an hour (`sleep`), computes for an hour inside one C call that
holds the GIL (`hog`: no thread of the process runs meanwhile, a timer in it included), computes so for about a
second (`hog_briefly`), returns 10 MB (`flood`), or ends its process (`die`).

`tests/FlakyCalc-v0`: Calc-v0 where a fixed share of the tasks breaks in one of those ways whatever the policy says
(the chaos runs' env faults: an untrained policy seldom calls a tool).
"""

from __future__ import annotations

import os
import time

import gymnasium

from agentrl.envs import ToolEnv, answer, call, tool
from agentrl.envs.calc import CalcEnv
from agentrl.envs.turns import AssistantTurn, ToolCall
from agentrl.reward import exact_match, parse_number

KINDS = ("ok", "raise", "sleep", "hog", "hog_briefly", "flood", "die")
ENV_ID = "tests/Fault-v0"


class FaultEnv(ToolEnv):
    instructions = "Call the probe as asked, then answer done."

    def __init__(self, **kwargs):
        tasks = [{"id": str(i), "what": KINDS[i % len(KINDS)], "answer": "done"} for i in range(7 * len(KINDS))]
        super().__init__(tasks, max_turns=3, **kwargs)

    @tool
    def probe(self, what: str) -> str:
        """Run the probe.

        Args:
            what: which probe.
        """
        if what == "raise":
            raise RuntimeError("the probe broke")
        if what == "sleep":
            time.sleep(3600)
        if what == "hog":
            sum(range(10**13))
        if what == "hog_briefly":
            sum(range(6 * 10**7))
        if what == "flood":
            return "x" * 10_000_000
        if what == "die":
            os._exit(3)
        return "probed"

    def prompt(self, task):
        return f"Run the probe with {task['what']}."

    def score(self, task, answer):
        return {"correct": exact_match(answer, task["answer"])}

    def oracle(self, task):
        return [call("probe", what=task["what"]), answer("done")]


def task_index(kind: str) -> int:
    return KINDS.index(kind)


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="tests.faulty_envs:FaultEnv")


# --- Calc-v0 with a broken env on a fixed share of its tasks (scripts/chaos.py) ------------------------------------
FLAKY_ENV_ID = "tests/FlakyCalc-v0"
FLAKY_KINDS = ("raise", "sleep", "flood", "die")


def flaky_kind(task_index: int, every: int) -> str | None:
    """The fault of task `task_index` (None: it works): every `every`-th task breaks, the kinds in turn."""
    return FLAKY_KINDS[(task_index // every) % len(FLAKY_KINDS)] if every and task_index % every == 0 else None


class FlakyCalcEnv(CalcEnv):
    """Calc-v0 whose first step breaks on every `fault_every`-th task, whatever the model said, unless it said what
    the oracle says (the oracle's own play, for the tokenizer's corpus and the SFT warm start, is spared): the env
    raises, hangs for an hour, has a tool return 10 MB, or ends its process. The same tasks break in every run, so a
    run with process faults and one without see the same env failures."""

    # a reward that varies within a group even for an untrained policy (how close the answer's number is), so that
    # the chaos runs' RL steps have advantages, gradients, and weights that depend on what was sampled
    reward_weights = {"correct": 1.0, "close": 0.5}

    def __init__(self, *, fault_every: int = 10, **kwargs):
        super().__init__(**kwargs)
        self.fault_every = fault_every

    def score(self, task, answer):
        value = parse_number(answer)
        close = 0.0 if value is None else 1.0 / (1.0 + min(abs(value - task["answer"]), 1e9))
        return {**super().score(task, answer), "close": close}

    @tool
    def flood(self) -> str:
        """Return a lot of text."""
        return "x" * 10_000_000

    def step(self, action):
        kind = flaky_kind(self.state.task_index, self.fault_every) if self.state.turn == 0 else None
        if kind and action.calls == self.oracle(self.state.task)[0].calls:
            kind = None
        if kind == "raise":
            raise RuntimeError(f"the env broke on task {self.state.task_index}")
        if kind == "sleep":
            time.sleep(3600)
        if kind == "die":
            os._exit(3)
        if kind == "flood":
            action = AssistantTurn(content=action.content, calls=(ToolCall("flood", {}),))
        return super().step(action)


if FLAKY_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=FLAKY_ENV_ID, entry_point="tests.faulty_envs:FlakyCalcEnv")
