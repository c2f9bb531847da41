"""Registering tool envs with gymnasium, making them by id, and listing them.

Built-in envs are registered in the ``agentrl/`` namespace with string entry points, so importing
``agentrl.envs`` imports no env module (and no ``datasets``) until an env is made. A user registers their own env the
same way, with ``gymnasium.register(id="myproject/MyEnv-v0", entry_point="mypackage.mymodule:MyEnv")``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

from agentrl.envs.tool_env import ToolEnv

NAMESPACE = "agentrl"

BUILTIN_ENVS = {
    "agentrl/Calc-v0": "agentrl.envs.calc:CalcEnv",
    "agentrl/PythonExec-v0": "agentrl.envs.python_exec:PythonExecEnv",
    "agentrl/DocSearch-v0": "agentrl.envs.doc_search:DocSearchEnv",
    "agentrl/KVChain-v0": "agentrl.envs.kv_chain:KVChainEnv",
}


def register_builtin_envs() -> None:
    for env_id, entry_point in BUILTIN_ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point)


def make(env_id: str, **kwargs: Any) -> ToolEnv:
    """The ``ToolEnv`` registered as ``env_id``, constructed with ``kwargs``, without gymnasium's wrappers.

    The rollout layer needs the env's own methods (``tool_schemas``, ``system_prompt``, ``get_state``), which
    wrappers hide. ``"Calc-v0"`` is accepted for ``"agentrl/Calc-v0"``; a ``"module:Env-v0"`` id imports ``module``
    first (gymnasium's convention), so a user's env registered at import time is found.
    """
    if env_id not in gym.registry and ":" not in env_id and f"{NAMESPACE}/{env_id}" in gym.registry:
        env_id = f"{NAMESPACE}/{env_id}"
    if env_id not in gym.registry and ":" not in env_id:
        raise ValueError(f"no environment registered as {env_id!r}; registered tool envs: {list_envs()}. "
                         "Register yours with gymnasium.register(id=..., entry_point='module:Class').")
    env = gym.make(env_id, disable_env_checker=True, **kwargs).unwrapped
    if not isinstance(env, ToolEnv):
        raise ValueError(f"{env_id!r} is a {type(env).__name__}, not an agentrl.envs.ToolEnv")
    return env


@dataclass(frozen=True, slots=True)
class EnvInfo:
    env_id: str
    entry_point: str
    tools: dict[str, str]  # name -> description; empty when the entry point is not a ToolEnv class
    error: str = ""  # why the entry point could not be loaded


def import_envs(modules: list[str]) -> list[str]:
    """Imports `modules` (a user's packages, which register their envs at import) and returns the env ids they added.
    A module that fails to import is a ValueError naming it."""
    before = set(gym.registry)
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise ValueError(f"importing {module!r} failed: {type(exc).__name__}: {exc}") from exc
    return sorted(set(gym.registry) - before)


def describe_envs(env_ids: list[str]) -> list[EnvInfo]:
    """Each env's entry point and tools, read from its class (no env is constructed: that may need kwargs)."""
    out = []
    for env_id in env_ids:
        entry = gym.registry[env_id].entry_point
        name = entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"
        try:
            creator = load_env_creator(entry) if isinstance(entry, str) else entry
        except Exception as exc:  # a registered module that does not import
            out.append(EnvInfo(env_id=env_id, entry_point=name, tools={}, error=f"{type(exc).__name__}: {exc}"))
            continue
        specs = getattr(creator, "tools", {}) if isinstance(creator, type) and issubclass(creator, ToolEnv) else {}
        out.append(EnvInfo(env_id=env_id, entry_point=name,
                           tools={spec.name: spec.description.strip().splitlines()[0] if spec.description else ""
                                  for spec in specs.values()}))
    return out


def list_envs(namespace: str | None = NAMESPACE) -> list[str]:
    """Registered env ids in ``namespace`` (all namespaces if None), sorted."""
    return sorted(env_id for env_id, spec in gym.registry.items()
                  if namespace is None or spec.namespace == namespace)
