"""Tool environments as gymnasium envs (imported as ``agentrl.envs``). Imports no torch, Ray or vLLM.

The pieces, one module each: ``tool_env`` (the ``ToolEnv`` base class and its episode contract), ``tools`` (typed
methods -> JSON schemas), ``protocol`` (the ``<tool_call>``/``<answer>`` format and its never-raising parser),
``sandbox`` (limits and isolation for code tools), ``episode`` (playing scripted and oracle turns), and the built-in
envs ``calc``, ``python_exec``, ``doc_search``, ``kv_chain``. docs/environments.md shows how to write a new env.
"""

from agentrl.envs.episode import Episode, continue_play, play
from agentrl.envs.errors import SandboxError, ToolError
from agentrl.envs.protocol import ParsedTurn, ToolCall, parse_turn
from agentrl.envs.registration import BUILTIN_ENVS, list_envs, make, register_builtin_envs
from agentrl.envs.sandbox import Sandbox, SandboxLimits, SandboxResult
from agentrl.envs.spaces import AnyText
from agentrl.envs.tool_env import EpisodeState, ToolEnv
from agentrl.envs.tools import ToolSpec, tool

register_builtin_envs()

__all__ = [
    "AnyText", "BUILTIN_ENVS", "Episode", "EpisodeState", "ParsedTurn", "Sandbox", "SandboxError", "SandboxLimits",
    "SandboxResult", "ToolCall", "ToolEnv", "ToolError", "ToolSpec", "continue_play", "list_envs", "make",
    "parse_turn", "play", "tool",
]
