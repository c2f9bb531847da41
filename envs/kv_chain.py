"""KVChain-v0: follow a chain of ``hops`` pointers through a key-value store, one ``lookup`` per hop.

Each task has its own store of random keys (``key-3f9a1c``). Starting from a given key, each value is the next key,
and the ``hops``-th lookup returns a final value ``VAL-...``: the answer. Each lookup depends on the previous
result, so the task needs exactly ``hops`` tool calls over ``hops`` turns: a long-horizon task whose horizon is the
``hops`` argument. Decoy chains of the same shape (and decoy final values) make guessing useless.

Reward: ``correct`` = exact match with the final value. Oracle: the ``hops`` lookups in order, then the answer.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any, Mapping

from agentrl.envs.errors import ToolError
from agentrl.envs.tool_env import ToolEnv, load_tasks
from agentrl.envs.tools import tool
from agentrl.envs.turns import AssistantTurn, answer, call
from agentrl.reward import exact_match

if TYPE_CHECKING:
    import datasets


def _chain_task(rng: random.Random, hops: int, num_decoys: int) -> tuple[dict[str, str], list[str], str]:
    """(store, chain of keys looked up in order, answer)."""
    needed = (hops + 1) * (num_decoys + 1)
    names = set()
    while len(names) < needed:
        names.add(f"key-{rng.getrandbits(24):06x}")
    pool = sorted(names)
    rng.shuffle(pool)
    store, chains = {}, []
    for c in range(num_decoys + 1):
        keys = pool[c * (hops + 1):(c + 1) * (hops + 1) - 1]
        final = f"VAL-{rng.getrandbits(32):08x}"
        for key, nxt in zip(keys, [*keys[1:], final]):
            store[key] = nxt
        chains.append((keys, final))
    keys, final = chains[0]
    return dict(sorted(store.items())), keys, final


def generate_tasks(num_tasks: int = 1000, seed: int = 0, *, hops: int = 8, num_decoys: int = 3) -> datasets.Dataset:
    """Columns: id, hops, start_key, chain (JSON list of the keys to look up), store (JSON object), answer."""
    import datasets

    if num_tasks <= 0 or hops <= 0 or num_decoys < 0:
        raise ValueError(f"need num_tasks > 0, hops > 0, num_decoys >= 0; got {num_tasks!r}, {hops!r}, "
                         f"{num_decoys!r}")
    rows = []
    for i in range(num_tasks):
        store, chain, answer = _chain_task(random.Random(f"kvchain:{seed}:{hops}:{i}"), hops, num_decoys)
        rows.append({"id": f"kvchain-{seed}-{hops}-{i}", "hops": hops, "start_key": chain[0],
                     "chain": json.dumps(chain), "store": json.dumps(store), "answer": answer})
    return datasets.Dataset.from_list(rows)


class KVChainEnv(ToolEnv):
    """Multi-hop lookups through a key-value tool."""

    instructions = "Look keys up one at a time; each value is the key to look up next."

    def __init__(self, tasks: Any = None, *, num_tasks: int = 1000, task_seed: int = 0, hops: int = 8,
                 num_decoys: int = 3, max_turns: int | None = None, **kwargs: Any) -> None:
        tasks = generate_tasks(num_tasks, task_seed, hops=hops, num_decoys=num_decoys) if tasks is None \
            else load_tasks(tasks)
        # Room for every hop plus a few mistakes; the budget scales with the horizon.
        super().__init__(tasks, max_turns=max_turns or 2 * int(tasks[0]["hops"]) + 4, **kwargs)
        self._store_cache: tuple[str, dict[str, str]] | None = None

    def _store(self) -> dict[str, str]:
        # Parsing the JSON store once per task, not once per lookup; keyed by task id so set_state stays correct.
        task = self.task
        if self._store_cache is None or self._store_cache[0] != task["id"]:
            self._store_cache = (task["id"], json.loads(task["store"]))
        return self._store_cache[1]

    @tool
    def lookup(self, key: str) -> str:
        """Return the value stored under a key.

        Args:
            key: the key to look up, e.g. "key-3f9a1c".
        """
        value = self._store().get(key.strip())
        if value is None:
            raise ToolError(f"no key {key[:80]!r} in the store")
        return value

    def prompt(self, task: Mapping[str, Any]) -> str:
        return (f"Start at key {task['start_key']}. Look it up; the value is the next key to look up. After exactly "
                f"{task['hops']} lookups you reach a value that starts with 'VAL-'. What is that value?")

    def score(self, task: Mapping[str, Any], answer: str) -> dict[str, float]:
        return {"correct": exact_match(answer, task["answer"])}

    def oracle(self, task: Mapping[str, Any]) -> list[AssistantTurn]:
        return [*(call("lookup", key=key) for key in json.loads(task["chain"])), answer(task["answer"])]
