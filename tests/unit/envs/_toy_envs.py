"""Small ToolEnvs for the env tests: each exercises one part of the ToolEnv contract."""

from __future__ import annotations

from typing import Any, Literal, Mapping

from agentrl.envs import AssistantTurn, SandboxError, ToolEnv, ToolError, answer, call, tool
from agentrl.reward import exact_match

TASKS = [{"id": f"toy-{i}", "question": f"What is {i} doubled?", "answer": str(2 * i)} for i in range(10)]


class ToyEnv(ToolEnv):
    """Tools that succeed, fail as the model's fault, and fail as the system's fault."""

    def __init__(self, tasks: Any = None, **kwargs: Any) -> None:
        super().__init__(TASKS if tasks is None else tasks, **kwargs)

    @tool
    def double(self, x: int) -> str:
        """Double an integer.

        Args:
            x: the number to double.
        """
        self.state.extra["doubled"] = self.state.extra.get("doubled", 0) + 1
        return str(2 * x)

    @tool
    def shout(self, text: str, times: int = 1, style: Literal["upper", "title"] = "upper") -> str:
        """Repeat text loudly."""
        return " ".join([text.upper() if style == "upper" else text.title()] * times)

    @tool
    def reject(self, reason: str) -> str:
        """Always refuses (a ToolError: the model's mistake)."""
        raise ToolError(f"refused: {reason}")

    @tool
    def crash(self) -> str:
        """Has a bug (the system's failure)."""
        raise RuntimeError("bug in the tool")

    @tool
    def sandbox_down(self) -> str:
        """The sandbox cannot start (the system's failure)."""
        raise SandboxError("could not start")

    @tool
    def flood(self, n: int) -> str:
        """Returns n characters."""
        return "x" * n

    def prompt(self, task: Mapping[str, Any]) -> str:
        return task["question"]

    def score(self, task: Mapping[str, Any], answer: str) -> dict[str, float]:
        if answer == "explode":
            raise RuntimeError("bug in score")
        return {"correct": exact_match(answer, task["answer"])}

    def oracle(self, task: Mapping[str, Any]) -> list[AssistantTurn]:
        return [call("double", x=int(task["id"].split("-")[1])), answer(task["answer"])]
