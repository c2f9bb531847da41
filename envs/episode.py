"""Play scripted assistant turns through a ``ToolEnv``: oracle (gold) episodes, tests, benchmarks, SFT data.

``play(env, env.oracle, seed=s)`` resets the env, asks the oracle for the gold turns of the task it picked, and steps
them; the result holds the conversation as structured data (the system prompt and tools, the task, each
``AssistantTurn`` and the ``ToolResults`` it got), the final reward and status. ``Episode.messages()`` gives the
conversation as OpenAI-style chat messages, the form chat templates take; a chat format renders it as its model's
tokens (``agentrl.chat``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.turns import AssistantTurn, ToolResults, with_call_ids


@dataclass
class Episode:
    """One played episode. ``status`` is "running" if the turns ran out before the episode ended."""

    task_id: str
    system: str = ""
    tools: list[dict[str, Any]] = field(default_factory=list)
    prompt: str = ""
    turns: list[AssistantTurn] = field(default_factory=list)
    observations: list[ToolResults] = field(default_factory=list)  # after each turn but the last
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

    def steps(self) -> list[tuple[AssistantTurn, ToolResults | None]]:
        """Each turn with the results it got (None after the last): what a chat format renders turn by turn."""
        return [(turn, self.observations[k] if k < len(self.observations) else None)
                for k, turn in enumerate(self.turns)]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI-style messages: system, user, then assistant messages (``tool_calls`` with
        JSON-string arguments, ``reasoning_content``) each followed by one ``tool`` message per result."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system},
                                     {"role": "user", "content": self.prompt}]
        for i, turn in enumerate(self.turns):
            message: dict[str, Any] = {"role": "assistant",
                                       "content": turn.answer if turn.answer is not None else turn.content}
            if turn.calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                         for c in turn.calls]
            if turn.reasoning is not None:
                message["reasoning_content"] = turn.reasoning
            out.append(message)
            if i < len(self.observations):
                out += [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content}
                        for r in self.observations[i].results]
        return out


def play(env: ToolEnv,
         turns: Iterable[AssistantTurn] | Callable[[Mapping[str, Any]], Iterable[AssistantTurn]], *,
         seed: int | None = None, options: dict[str, Any] | None = None) -> Episode:
    """Reset ``env`` and step ``turns`` until the episode ends or they run out.

    ``turns`` is a list of ``AssistantTurn``s, or a function of the task returning one (e.g. ``env.oracle``).
    """
    prompt, info = env.reset(seed=seed, options=options)
    episode = Episode(task_id=info["task_id"], system=env.system_prompt(), tools=env.tool_schemas(), prompt=prompt)
    return continue_play(env, turns(env.task) if callable(turns) else turns, episode)


def continue_play(env: ToolEnv, turns: Iterable[AssistantTurn], episode: Episode) -> Episode:
    """Step ``turns`` through an env that is mid-episode (after ``reset`` or ``set_state``), extending ``episode``.

    Calls get the ids the env gives them, so ``messages()`` pairs every result with its call.
    """
    for turn in turns:
        observation, reward, terminated, truncated, info = env.step(turn)
        episode.turns.append(with_call_ids(turn, env.state.turn))
        episode.rewards.append(reward)
        episode.infos.append(info)
        episode.status = info["status"]
        if terminated or truncated:
            episode.terminated, episode.truncated = terminated, truncated
            break
        episode.observations.append(observation)
    return episode
