"""A run whose policy collapsed, and what undoes it.

After one unlucky update a sharpened policy can fail every episode alike: every group's rewards are then equal, GRPO
has no advantage to learn from, no group trains, and the policy never changes again — the run idles to its last step
(docs/benchmarks.md, "Three times the RL steps": one ordinary update flipped the quickstart's decision to answer, and
the run idled for its remaining 54 steps). StallWatch tells the driver when that happened, so that it can go back to
the checkpoint saved before that update (PolicyTrainer.roll_back) and go on with the next steps' tasks: the data moves
on, as a pre-training run restarted before a loss spike skips the batches that led to it.
"""

from __future__ import annotations

STALLED_STEPS = 3  # RL steps in a row that trained no group before a run counts as stalled


def restored_policy(rl_step: int) -> str:
    """How the console, the log and the run summary name the policy a rollback restored (RL step 0: the warm start)."""
    return f"RL step {rl_step}'s policy" if rl_step else "the warm start's policy"


class StallWatch:
    """Fed each RL step's trained groups and sampled success rate; says when the last update stalled the run."""

    def __init__(self, steps: int = STALLED_STEPS):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.steps = steps
        self.idle: list[float] = []  # the success rates of the trailing steps that trained nothing
        self.before: float | None = None  # that of the last step that trained: sampled before its update

    def observe(self, trained_groups: int, success: float | None) -> bool:
        """Records one RL step. True once the last `steps` steps trained no group and their success rate is below
        that of the last step that did, i.e. its update made a policy that fails alike where it used to learn. A run
        whose groups all succeed is done, not stalled; one that never trained has no update to undo."""
        if trained_groups:
            self.before, self.idle = success or 0.0, []
            return False
        self.idle.append(success or 0.0)
        return (len(self.idle) >= self.steps and self.before is not None
                and sum(self.idle) / len(self.idle) < self.before)

    def state(self) -> dict:
        """What a checkpoint carries, so that a run resumed in the middle of a stall still sees it."""
        return {"before": self.before, "idle": list(self.idle)}

    @classmethod
    def resumed(cls, state: dict | None) -> StallWatch:
        """The watch as a checkpoint's `state()` left it (a fresh one for None)."""
        watch = cls()
        if state:
            watch.before, watch.idle = state["before"], list(state["idle"])
        return watch

    def reset(self) -> None:
        """After a rollback: the restored policy is judged by the updates it makes from now on."""
        self.idle, self.before = [], None
