"""DeepSpeed ranks as Ray actors: `ray.remote(PolicyTrainer)`, one per bundle of a placement group.

The driver calls the group's typed methods, each one remote call on every rank (they take part in the same
collectives) that returns rank 0's answer:

    group = create_trainer_group(config, "/ckpt/initial", num_ranks=2)
    metrics = group.step(batch.trajectories)         # one copy in the object store, read by every rank
    published = group.publish_weights()

A rank that dies, or a call that outlasts `call_timeout_s`, raises ActorLost at once (agentrl.failures): the driver
restarts the job from its last checkpoint.

Rank 0's node address and a free port there are found by a zero-CPU task in the first bundle, then every rank is
created with its RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and joins the process group in its
constructor. With GPUs, Ray gives each actor one device (CUDA_VISIBLE_DEVICES), so its local rank is 0.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, \
    remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentrl.failures import ActorLost, first_line
from agentrl.net import free_port
from agentrl.trainer.config import TrainerConfig

PolicyTrainerActor = None  # ray.remote(PolicyTrainer), made on first use so that importing this needs no DeepSpeed


@ray.remote(num_cpus=0)
def _rendezvous_address() -> tuple[str, int]:
    """Rank 0's node address and a port free there (imports nothing heavy: it runs before the ranks start)."""
    return ray.util.get_node_ip_address(), free_port()


@dataclass(kw_only=True)
class TrainerGroup:
    """The rank actors (call methods on all of them, in the same order) and their placement group."""

    ranks: list[Any]
    placement_group: PlacementGroup
    call_timeout_s: float | None = None  # how long the driver waits for a call on every rank (None: forever)

    # --- PolicyTrainer's methods, on every rank -----------------------------------------------------------------------
    def step(self, trajectories: Sequence[Any] | ray.ObjectRef, loss: Any = None) -> dict[str, float]:
        """One optimizer step on `trajectories` (PolicyTrainer.step; `loss` a LossConfig, default the trainer's): a
        list, or a reference to one in the object store (the store's batch, which then never passes through here)."""
        if not isinstance(trajectories, ray.ObjectRef):
            trajectories = ray.put(list(trajectories))  # one copy in the object store for all ranks
        return self._on_all("step", trajectories, loss)

    def publish_weights(self) -> Any:
        """The current weights as a new policy version (a PublishedWeights)."""
        return self._on_all("publish_weights")

    def sync_weights(self, receivers: Any, *, bucket_bytes: int, dtype: str | None = None) -> Any:
        """Streams the current weights into `receivers` (agentrl.rollout.worker.WorkerReceivers) in memory, one
        decoder layer at a time, in `dtype` (the engines'; trainer/weight_stream.py); returns rank 0's SyncRecord."""
        return self._on_all("sync_weights", receivers, bucket_bytes, dtype)

    def save_checkpoint(self, client_state: dict) -> str:
        """A resumable checkpoint carrying `client_state`; returns its directory."""
        return self._on_all("save_checkpoint", client_state)

    def load_checkpoint(self, path: str | None = None) -> dict:
        """Restores the newest (or `path`'s) checkpoint; returns the client state saved with it."""
        return self._on_all("load_checkpoint", path)

    def roll_back(self) -> dict:
        """Restores the checkpoint before the last update as the next policy version (PolicyTrainer.roll_back);
        returns the client state saved with it."""
        return self._on_all("roll_back")

    def set_lr(self, lr: float) -> None:
        self._on_all("set_lr", lr)

    def reset_reference(self) -> None:
        """The KL term's reference becomes the current policy."""
        self._on_all("reset_reference")

    def _on_all(self, method: str, *args: Any) -> Any:
        """`method` on every rank; rank 0's answer. Waits for the ranks as they finish, not rank 0 first: the others
        would wait in their collectives for a missing rank up to trainer.dist_timeout_s, hanging the driver as long."""
        refs = [getattr(rank, method).remote(*args) for rank in self.ranks]
        deadline = None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
        waiting = list(refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1,
                                     timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if not done:
                raise ActorLost(f"trainer rank(s) {sorted(refs.index(r) for r in waiting)} did not finish {method} "
                                f"within cluster.trainer_timeout_s={self.call_timeout_s:g}s")
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                raise ActorLost(f"trainer rank {refs.index(done[0])} died during {method}: {first_line(exc)}") from exc
        return ray.get(refs[0])

    def shutdown(self) -> None:
        """Kills the rank actors and frees their resources."""
        for actor in self.ranks:
            ray.kill(actor)
        remove_placement_group(self.placement_group)


def create_trainer_group(config: TrainerConfig, model: Any, *, num_ranks: int, num_cpus_per_rank: float = 1,
                         num_gpus_per_rank: float = 0, strategy: str = "PACK",
                         call_timeout_s: float | None = None) -> TrainerGroup:
    """Places `num_ranks` PolicyTrainer actors and waits until every one has joined the process group.

    `model` is what PolicyTrainer takes: preferably a checkpoint path (every rank loads it) or a HybridMoEConfig.
    On CPU each rank uses `num_cpus_per_rank` torch threads unless config.num_threads says otherwise.
    """
    global PolicyTrainerActor
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if PolicyTrainerActor is None:
        from agentrl.trainer.policy_trainer import PolicyTrainer

        PolicyTrainerActor = ray.remote(PolicyTrainer)
    if config.num_threads is None and not num_gpus_per_rank:
        config = dataclasses.replace(config, num_threads=max(1, int(num_cpus_per_rank)))
    bundle = {"CPU": num_cpus_per_rank, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
    pg = placement_group([dict(bundle) for _ in range(num_ranks)], strategy=strategy)
    ray.get(pg.ready())
    master_addr, master_port = ray.get(_rendezvous_address.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)).remote())
    node_of = placement_group_table(pg)["bundles_to_node_id"]
    local_ranks = [sum(node_of[j] == node_of[r] for j in range(r)) for r in range(num_ranks)]
    ranks = [
        PolicyTrainerActor.options(
            num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
        ).remote(config, model, rank=r, world_size=num_ranks, master_addr=master_addr, master_port=master_port,
                 local_rank=0 if num_gpus_per_rank else local_ranks[r])
        for r in range(num_ranks)
    ]
    try:
        ray.get([r.info.remote() for r in ranks])
    except Exception:
        TrainerGroup(ranks=ranks, placement_group=pg).shutdown()
        raise
    return TrainerGroup(ranks=ranks, placement_group=pg, call_timeout_s=call_timeout_s)


__all__ = ["TrainerGroup", "create_trainer_group"]
