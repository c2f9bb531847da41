"""A user's env package, written where a test wants it (outside the repository): `unitspkg.env` registers
`units/Units-v0`, a unit-conversion ToolEnv with one tool that takes a required constructor argument (`scale`) and,
with `broken=True`, raises on every step."""

from __future__ import annotations

import textwrap
from pathlib import Path

ENV_ID = "unitspkg.env:units/Units-v0"

SOURCE = '''
import gymnasium
from agentrl.envs import ToolEnv, answer, call, tool
from agentrl.reward import numeric_match

FACTORS = {"km": 1000.0, "m": 1.0, "cm": 0.01}


class UnitsEnv(ToolEnv):
    instructions = "Convert with the tool, then answer with the number."

    def __init__(self, *, scale: float, broken: bool = False, **kwargs):
        self.scale, self.broken = scale, broken
        tasks = [{"id": str(i), "value": float(i) * scale, "unit": u, "answer": float(i) * scale * FACTORS[u]}
                 for i in range(1, 41) for u in FACTORS]
        super().__init__(tasks, max_turns=3, **kwargs)

    @tool
    def to_metres(self, value: float, unit: str) -> str:
        """Convert a length to metres.

        Args:
            value: the number.
            unit: km, m or cm.
        """
        if self.broken:
            raise RuntimeError("the unit table is gone")
        return str(value * FACTORS[unit])

    def step(self, action):
        if self.broken:
            raise ZeroDivisionError("units env broke")
        return super().step(action)

    def prompt(self, task):
        return f"How many metres are {task['value']} {task['unit']}?"

    def score(self, task, answer):
        return {"correct": numeric_match(answer, task["answer"])}

    def oracle(self, task):
        return [call("to_metres", value=task["value"], unit=task["unit"]), answer(str(task["answer"]))]


gymnasium.register(id="units/Units-v0", entry_point="unitspkg.env:UnitsEnv")
'''


def write_user_package(project: Path) -> Path:
    """`project/unitspkg/` with the env; returns `project`."""
    pkg = project / "unitspkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "env.py").write_text(textwrap.dedent(SOURCE))
    return project
