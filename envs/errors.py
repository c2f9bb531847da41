"""The typed errors of ``agentrl.envs``, and the boundaries a failure is attributed to.

Two kinds of failure must never be confused, because they train the policy differently:

* the model's fault (a malformed tool call, a wrong argument, code that raises): the env turns it into an
  observation that says what was wrong, and the episode goes on;
* the system's fault (a tool crashed, the sandbox could not start, a timeout the system caused): the episode
  ends with status ``"failed"`` and the boundary that failed, and the trajectory is excluded from advantages
  (see ``agentrl.reward``) instead of being scored 0.
"""

from __future__ import annotations

from typing import Literal

# Which part of the system failed. "model" failures are not infrastructure failures and never end an episode
# as failed, so they are not listed here.
Boundary = Literal["env", "tool", "sandbox"]
BOUNDARIES: tuple[str, ...] = ("env", "tool", "sandbox")


class ToolError(Exception):
    """Raised by a tool for a mistake the model made (unknown id, out-of-range offset, bad expression).

    The message is shown to the model as the tool's result, so it should say what was wrong and how to fix it.
    """


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, crashed, or timed out before running the code).

    Distinct from code that fails inside a working sandbox, which is a ``SandboxResult`` with a non-"ok" outcome.
    """
