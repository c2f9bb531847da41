"""``ToolEnv``: a multi-turn tool-calling task as a ``gymnasium.Env`` whose actions are parsed assistant turns.

The rollout layer drives it like this (see docs/environments.md)::

    env = agentrl.envs.make("agentrl/Calc-v0")
    system = env.system_prompt()             # the env's own instructions (format-free)
    tools = env.tool_schemas()               # the tools, OpenAI function style
    prompt, info = env.reset(seed=s)         # the task: the first user message
    turn = chat_format.parse_turn(sampled_ids)                            # an AssistantTurn
    obs, reward, terminated, truncated, info = env.step(turn)            # obs: ToolResults to render back

The env never sees markup: a chat format (``agentrl.chat``) renders the system prompt with the tools, the prompt and
the results into the model's template, and parses what the model writes into ``AssistantTurn``s
(``agentrl.envs.turns``). One env runs unchanged under every format.

Episode semantics:

* ``terminated``: the model gave a final answer; ``reward`` is the weighted total of ``info["reward_components"]``.
* ``truncated``: the turn budget (``max_turns``) or the observation budget (``max_observation_chars`` of tool results
  and error messages summed over the episode) ran out, or the system failed. Reward components are then all 0.
* Every other step returns reward 0 and the tool results (and what was wrong with the turn) as the observation.
* ``info["status"]``: "running", "completed", "truncated" or "failed". "failed" comes with
  ``info["failure"] = {"boundary": "env" | "tool" | "sandbox", "message": ...}``: the system, not the model, failed,
  and the episode must be excluded from advantages (``agentrl.reward.group_advantages``).

The whole episode lives in ``self.state`` (JSON-serialisable), so a partial rollout is saved with ``get_state()`` and
resumed in another process with ``set_state()``. A subclass that keeps mutable per-episode data must keep it in
``self.state.extra``; caches derived from the task (e.g. generated documents) may live anywhere.

A subclass provides tasks (a ``datasets.Dataset``, a path saved with ``save_to_disk``, or a list of dicts), tools
(``@tool`` methods), ``prompt(task)``, ``score(task, answer) -> components`` and, optionally, ``oracle(task)`` (gold
``AssistantTurn``s: ``call(...)`` and ``answer(...)``) and ``instructions``. Class attribute ``reward_weights`` names
the components ``score`` returns.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import gymnasium as gym

from agentrl.envs.errors import SandboxError, ToolError
from agentrl.envs.spaces import AssistantTurns, Observations
from agentrl.envs.tools import ToolSpec, collect_tools, validate_arguments
from agentrl.envs.turns import AssistantTurn, ToolCall, ToolResult, ToolResults, with_call_ids
from agentrl.reward import RewardResult, format_penalty

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)


@dataclass
class EpisodeState:
    """Everything an episode has done so far; ``dataclasses.asdict`` of it is JSON-serialisable."""

    task_index: int
    task: dict[str, Any]
    turn: int = 0
    observation_chars: int = 0
    malformed_turns: int = 0
    status: str = "running"  # running | completed | truncated | failed
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status != "running"


def load_tasks(tasks: datasets.Dataset | Sequence[Mapping[str, Any]] | str) -> Any:
    """``tasks`` itself, or the ``datasets.Dataset`` saved (``save_to_disk``) at the path ``tasks``."""
    if isinstance(tasks, str):
        import datasets  # here, not at module import: loading it costs ~1 s

        return datasets.load_from_disk(tasks)
    return tasks


class ToolEnv(gym.Env[Any, AssistantTurn]):
    """Base class of text tool environments. See the module docstring for the contract."""

    # render_fps only quiets gymnasium's checker: "ansi" renders text, not frames.
    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    reward_weights: ClassVar[Mapping[str, float]] = {"correct": 1.0}
    instructions: ClassVar[str] = ""  # env-specific guidance appended to the system prompt
    tools: ClassVar[dict[str, ToolSpec]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tools = collect_tools(cls)  # a bad tool signature fails here, when the class is defined

    def __init__(self, tasks: datasets.Dataset | Sequence[Mapping[str, Any]] | str, *, max_turns: int = 16,
                 max_observation_chars: int = 200_000, max_tool_output_chars: int = 20_000,
                 max_calls_per_turn: int = 8, format_penalty: float = 0.0, render_mode: str | None = None) -> None:
        for name, value in (("max_turns", max_turns), ("max_observation_chars", max_observation_chars),
                            ("max_tool_output_chars", max_tool_output_chars),
                            ("max_calls_per_turn", max_calls_per_turn)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive int, got {value!r}")
        if format_penalty < 0:
            raise ValueError(f"{type(self).__name__}: format_penalty must be >= 0, got {format_penalty!r}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"{type(self).__name__}: render_mode must be None or 'ansi', got {render_mode!r}")
        tasks = load_tasks(tasks)
        if len(tasks) == 0:
            raise ValueError(f"{type(self).__name__}: the task set is empty")
        self.tasks = tasks
        self.max_turns = max_turns
        self.max_observation_chars = max_observation_chars
        self.max_tool_output_chars = max_tool_output_chars
        self.max_calls_per_turn = max_calls_per_turn
        self.format_penalty = format_penalty
        self.render_mode = render_mode
        self.observation_space = Observations(max_length=max(max_observation_chars, 1_000_000))
        self.action_space = AssistantTurns(tool_names=tuple(self.tools))
        self.state: EpisodeState | None = None
        self._last_observation: str | ToolResults = ""

    # ---- what a subclass provides -------------------------------------------------------------------------------

    def prompt(self, task: Mapping[str, Any]) -> str:
        """The task as the first user message."""
        raise NotImplementedError(f"{type(self).__name__} must implement prompt(task)")

    def score(self, task: Mapping[str, Any], answer: str) -> Mapping[str, float]:
        """Reward components for a final answer; keys must match ``reward_weights``."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(task, answer)")

    def oracle(self, task: Mapping[str, Any]) -> list[AssistantTurn]:
        """The gold assistant turns for ``task`` (for SFT warm starts and to test that gold scores 1.0)."""
        raise NotImplementedError(f"{type(self).__name__} has no oracle")

    # ---- what the rollout layer calls ---------------------------------------------------------------------------

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools in OpenAI function-calling form (``{"type": "function", "function": {...}}``)."""
        return [spec.schema() for spec in self.tools.values()]

    def system_prompt(self) -> str:
        """The env's own guidance for the system message ("" for none); the chat format adds how to call tools and
        the tool schemas in its model's own way."""
        return self.instructions.strip()

    @property
    def task(self) -> dict[str, Any]:
        """The current episode's task (a row of ``self.tasks``)."""
        if self.state is None:
            raise RuntimeError("no task yet: call reset() first")
        return self.state.task

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Pick a task (``options={"task_index": i}`` picks one explicitly) and return its prompt."""
        super().reset(seed=seed)
        options = options or {}
        if "task_index" in options:
            index = options["task_index"]
            if not isinstance(index, int) or not 0 <= index < len(self.tasks):
                raise ValueError(f"options['task_index'] must be an int in [0, {len(self.tasks)}), got {index!r}")
        else:
            index = int(self.np_random.integers(len(self.tasks)))
        self.state = EpisodeState(task_index=index, task=dict(self.tasks[index]))
        self._last_observation = self.prompt(self.state.task)
        return self._last_observation, {"task_id": self._task_id(), "task_index": index, "status": "running"}

    def step(self, action: AssistantTurn) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Run ``action``'s tool calls or score its answer. See the module docstring."""
        state = self.state
        if state is None or state.done:
            raise RuntimeError("step() called without a running episode: call reset() first")
        if not isinstance(action, AssistantTurn):
            raise TypeError(f"{type(self).__name__}.step takes an AssistantTurn (what a chat format parsed from the "
                            f"model's message), got {type(action).__name__}; for text in agentrl's tag protocol use "
                            "agentrl.chat.parse_text(text)")
        state.turn += 1
        errors = list(action.errors)
        tool_calls = list(with_call_ids(action, state.turn).calls)
        if len(tool_calls) > self.max_calls_per_turn:
            errors.append(f"At most {self.max_calls_per_turn} tool calls are allowed per message; {len(tool_calls)} "
                          f"were given and only the first {self.max_calls_per_turn} were considered.")
            tool_calls = tool_calls[:self.max_calls_per_turn]
        state.malformed_turns += bool(errors) or any(c.error is not None for c in tool_calls)
        info: dict[str, Any] = {
            "task_id": self._task_id(), "turn": state.turn, "status": "running", "failure": None,
            "tool_calls": [c.to_dict() for c in tool_calls if c.error is None], "tool_results": [],
            "errors": list(errors), "answer": action.answer, "reward_components": {},
        }
        if action.answer is not None and not errors:
            return self._finish(info, self._score(action.answer), "completed", ToolResults())
        results, failure = [], None
        for c in tool_calls:
            if c.error is not None:
                content, error = "", c.error
            else:
                content, error, failure = self._run_tool(c)
            if failure:
                break
            if error:
                content = f"Error: {error}"
                info["errors"].append(error)
            results.append(ToolResult(call_id=c.id, name=c.name, content=content, is_error=error is not None))
        info["tool_results"] = [r.to_dict() for r in results]
        if failure:
            return self._finish(info, failure, "failed", ToolResults())
        observation = ToolResults(results=tuple(results), errors=tuple(errors))
        room = self.max_observation_chars - state.observation_chars
        if observation.num_chars >= room:
            observation = _cut(observation, max(room, 0))
            state.observation_chars += observation.num_chars
            info["errors"].append(f"observation budget of {self.max_observation_chars} characters exhausted")
            return self._finish(info, self._unanswered(), "truncated", observation)
        state.observation_chars += observation.num_chars
        if state.turn >= self.max_turns:
            return self._finish(info, self._unanswered(), "truncated", observation)
        self._last_observation = observation
        return observation, 0.0, False, False, info

    def get_state(self) -> dict[str, Any]:
        """The episode so far plus the RNG state, as JSON-serialisable data for ``set_state``."""
        if self.state is None:
            raise RuntimeError("no episode to save: call reset() first")
        return {"episode": dataclasses.asdict(self.state), "np_random": self.np_random.bit_generator.state}

    def set_state(self, saved: Mapping[str, Any]) -> None:
        """Resume an episode saved by ``get_state`` (possibly in another process); the next call is ``step``."""
        try:
            self.state = EpisodeState(**saved["episode"])
            self.np_random.bit_generator.state = saved["np_random"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a state saved by {type(self).__name__}.get_state(): {exc}") from exc
        self._last_observation = ""

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.state is None:
            return None
        s, last = self.state, self._last_observation
        if isinstance(last, ToolResults):
            last = "\n".join([*(f"[{r.name} {r.call_id}] {r.content}" for r in last.results),
                              *(f"Error: {e}" for e in last.errors)])
        return f"[{self._task_id()} turn {s.turn} {s.status}]\n{last}"

    # ---- internals ----------------------------------------------------------------------------------------------

    def _task_id(self) -> str:
        assert self.state is not None
        return str(self.state.task.get("id", self.state.task_index))

    def _run_tool(self, call: ToolCall) -> tuple[str, str | None, RewardResult | None]:
        """(result text, the model's mistake or None, the system's failure or None)."""
        spec = self.tools.get(call.name)
        if spec is None:
            return "", f"unknown tool {call.name[:80]!r}; the tools are {', '.join(self.tools) or 'none'}.", None
        arguments, problems = validate_arguments(spec, call.arguments)
        if problems:
            return "", " ".join(problems), None
        try:
            output = getattr(self, spec.method)(**arguments)
        except ToolError as exc:
            return "", f"{call.name}: {exc}", None
        except SandboxError as exc:
            log.warning("sandbox failure in tool %s: %s", call.name, exc)
            return "", None, RewardResult.failed("sandbox", f"{call.name}: {exc}")
        except Exception:  # noqa: BLE001 - a tool bug is the system's failure, recorded as data, not a crash
            log.exception("tool %s raised", call.name)
            return "", None, RewardResult.failed("tool", f"{call.name} raised:\n{traceback.format_exc(limit=8)}")
        text = output if isinstance(output, str) else str(output)
        if len(text) > self.max_tool_output_chars:
            text = (text[:self.max_tool_output_chars]
                    + f"\n[output truncated: {len(text) - self.max_tool_output_chars} more characters]")
        return text, None, None

    def _score(self, answer: str) -> RewardResult:
        assert self.state is not None
        try:
            components = dict(self.score(self.state.task, answer))
            return self._compose(components)
        except SandboxError as exc:
            return RewardResult.failed("sandbox", f"scoring: {exc}")
        except Exception:  # noqa: BLE001 - a scoring bug must not be mistaken for a wrong answer
            log.exception("scoring failed")
            return RewardResult.failed("env", f"score() raised:\n{traceback.format_exc(limit=8)}")

    def _unanswered(self) -> RewardResult:
        return self._compose({name: 0.0 for name in self.reward_weights})

    def _compose(self, components: dict[str, float]) -> RewardResult:
        assert self.state is not None
        weights = dict(self.reward_weights)
        if self.format_penalty:
            components["format"] = format_penalty(self.state.malformed_turns, per_turn=self.format_penalty)
            weights["format"] = 1.0
        return RewardResult.scored(components, weights)

    def _finish(self, info: dict[str, Any], result: RewardResult, status: str,
                observation: ToolResults) -> tuple[ToolResults, float, bool, bool, dict[str, Any]]:
        assert self.state is not None
        status = "failed" if result.status == "failed" else status
        self.state.status = status
        self._last_observation = observation
        info.update(status=status, failure=result.failure, reward_components=result.components)
        return observation, result.total, status == "completed", status != "completed", info


def _cut(observation: ToolResults, room: int) -> ToolResults:
    """``observation`` cut to ``room`` characters: results in order, then errors, each cut where the room ends."""
    results, errors = [], []
    for r in observation.results:
        results.append(replace(r, content=r.content[:room]))
        room -= len(results[-1].content)
    for e in observation.errors:
        if room <= 0:
            break
        errors.append(e[:room])
        room -= len(errors[-1])
    return ToolResults(results=tuple(results), errors=tuple(errors))
