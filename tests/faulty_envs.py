"""Envs that fail the ways tools fail in the wild, for the rollout layer's fault tests (and scripts/chaos.py).

`tests/Fault-v0`: task i asks the policy to call `probe(what=KINDS[i % len(KINDS)])`, then answer "done". The probe
returns normally (`ok`), raises (`raise`), sleeps for an hour (`sleep`), computes for an hour inside one C call that
holds the GIL (`hog`: no thread of the process runs meanwhile, a timer in it included), computes so for about a
second (`hog_briefly`), returns 10 MB (`flood`), or ends its process (`die`).
"""

from __future__ import annotations

import os
import time

import gymnasium

from agentrl.envs import ToolEnv, answer, call, tool
from agentrl.reward import exact_match

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
