"""Tool environments as gymnasium envs (imported as ``agentrl.envs``). Imports no torch, Ray or vLLM.

The pieces, one module each: ``tool_env`` (the ``ToolEnv`` base class and its episode contract), ``turns`` (parsed
assistant turns and tool results: what an env exchanges with the policy, free of any chat format), ``tools`` (typed
methods -> JSON schemas), ``sandbox`` (limits and isolation for code tools), ``episode`` (playing scripted and oracle
turns), and the built-in envs ``calc``, ``python_exec``, ``doc_search``, ``kv_chain``. How a model writes calls and
reads results is its chat format's business (``agentrl.chat``). docs/environments.md shows how to write a new env.
"""

from agentrl.envs.episode import Episode, continue_play, play
from agentrl.envs.errors import SandboxError, ToolError
from agentrl.envs.registration import (BUILTIN_ENVS, EnvInfo, describe_envs, import_envs, list_envs, make,
                                      register_builtin_envs)
from agentrl.envs.sandbox import Sandbox, SandboxLimits, SandboxResult
from agentrl.envs.spaces import AnyText, AssistantTurns, Observations
from agentrl.envs.tool_env import EpisodeState, ToolEnv
from agentrl.envs.tools import ToolSpec, tool
from agentrl.envs.turns import AssistantTurn, ToolCall, ToolResult, ToolResults, answer, call, calls, with_call_ids

register_builtin_envs()

__all__ = [
    "AnyText", "AssistantTurn", "AssistantTurns", "BUILTIN_ENVS", "EnvInfo", "Episode", "EpisodeState", "Observations",
    "Sandbox",
    "SandboxError", "SandboxLimits", "SandboxResult", "ToolCall", "ToolEnv", "ToolError", "ToolResult", "ToolResults",
    "ToolSpec", "answer", "call", "calls", "continue_play", "describe_envs", "import_envs", "list_envs", "make", "play", "tool", "with_call_ids",
]
