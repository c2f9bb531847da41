"""Play scripted assistant messages through a ``ToolEnv``: oracle (gold) episodes, tests, benchmarks, SFT data.

``play(env, env.oracle, seed=s)`` resets the env, asks the oracle for the gold messages of the task it picked, and
steps them; the result holds the chat transcript (system, user, assistant and tool messages), ready to be written as
an SFT example, and the final reward and status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from agentrl.envs.tool_env import ToolEnv


@dataclass
class Episode:
    """One played episode. ``status`` is "running" if the messages ran out before the episode ended."""

    task_id: str
    messages: list[dict[str, str]] = field(default_factory=list)  # {"role": ..., "content": ...}
    rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    status: str = "running"
    terminated: bool = False
    truncated: bool = False

    @property
    def reward(self) -> float:
        """The episode return (the final step's reward: earlier steps return 0)."""
        return sum(self.rewards)

    @property
    def reward_components(self) -> dict[str, float]:
        return self.infos[-1]["reward_components"] if self.infos else {}

    @property
    def num_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


def play(env: ToolEnv, turns: Iterable[str] | Callable[[Mapping[str, Any]], Iterable[str]], *,
         seed: int | None = None, options: dict[str, Any] | None = None) -> Episode:
    """Reset ``env`` and step ``turns`` until the episode ends or they run out.

    ``turns`` is a list of assistant messages, or a function of the task returning one (e.g. ``env.oracle``).
    """
    prompt, info = env.reset(seed=seed, options=options)
    episode = Episode(task_id=info["task_id"], messages=[{"role": "system", "content": env.system_prompt()},
                                                         {"role": "user", "content": prompt}])
    messages = turns(env.task) if callable(turns) else turns
    return continue_play(env, messages, episode)


def continue_play(env: ToolEnv, turns: Iterable[str], episode: Episode) -> Episode:
    """Step ``turns`` through an env that is mid-episode (after ``reset`` or ``set_state``), extending ``episode``."""
    for text in turns:
        observation, reward, terminated, truncated, info = env.step(text)
        episode.messages.append({"role": "assistant", "content": text})
        episode.rewards.append(reward)
        episode.infos.append(info)
        episode.status = info["status"]
        if terminated or truncated:
            episode.terminated, episode.truncated = terminated, truncated
            break
        episode.messages.append({"role": "tool", "content": observation})
    return episode
