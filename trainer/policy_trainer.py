"""PolicyTrainer: one DeepSpeed data-parallel rank of the policy optimizer.

Every rank is given the *same* list of trajectories for a step and plans the step identically (trainer/batching.py):
it takes its share of the sequences, packed into micro-batches by a token budget, runs one forward and backward per
micro-batch (padding so all ranks run as many), then one optimizer step, then the Quantile Balancing bias update of
every MoE layer from histograms summed over the ranks. The loss of each micro-batch is already normalised over the
whole step batch, and DeepSpeed averages gradients over the ranks, so each rank scales its loss by the world size:
the gradient is that of the whole batch's loss, however it was split.

`step(trajectories)` → metrics; `publish_weights()` → PublishedWeights (`<run_dir>/weights/v{N}`);
`sync_weights(receivers)` → SyncRecord (the weights streamed to the rollout engines in memory);
`save_checkpoint()` / `load_checkpoint()` (model, optimizer, QB biases, step, version, RNG and whatever the caller
adds, e.g. the store's position); `logprobs(trajectories)` for evaluation. SFT is the same step with
`LossConfig(kind="sft")`, configured or passed to `step`. All of them are collective: every rank calls them, in the
same order.

The Ray actor is `ray.remote(PolicyTrainer)` (trainer/actor.py places the ranks); the class works without Ray, e.g.
with world_size=1 or under torchrun-style launchers.

With `expert_parallel` = N > 1 the routed experts of every MoE layer are sharded over groups of N consecutive
ranks (agentrl/model/expert_parallel.py: tokens travel by all-to-all); all ranks stay data-parallel for everything
else, and ZeRO-2 averages expert gradients over the ranks holding the same experts (trainer/zero.py). Publishing and
`full_state_dict` gather the experts, so the weights leave in the non-EP layout; checkpoints add that layout as
shards (trainer/expert_checkpoint.py). `step` reports the all-to-all time as `ep/all_to_all_s`.

Muon is not offered: ZeRO-2/3 hand the optimizer flat shards of the parameters, and Muon's orthogonalisation needs
each whole matrix. A frozen copy of the initial model is the KL reference (kl_coef > 0); under ZeRO-3 it is not
sharded.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from agentrl.model.config import HybridMoEConfig
from agentrl.model.expert_parallel import (
    ExpertParallelStats, apply_expert_parallel, expert_parameter_names, gather_full_experts)
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.net import free_port
from agentrl.trainer import zero
from agentrl.trainer.batching import MicroBatch, StepPlan, context_slice, mini_batch_indices, pack, plan_step
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.cuda_graphs import GraphedForward
from agentrl.trainer.expert_checkpoint import MODEL_DIR, load_local_experts, save_model_shards, saved_expert_parallel
from agentrl.trainer.forward import PackedPolicy, micro_batch_loss
from agentrl.trainer.losses import LossConfig, grpo_advantages, read_sums
from agentrl.trainer.publish import PublishedWeights, write_weights
from agentrl.trainer.weight_stream import Receivers, SyncRecord, stream_weights
from agentrl.weight_buckets import BucketRing
from agentrl.types import Trajectory

CHECKPOINT_DIR = "checkpoints"


class PolicyTrainer:
    """One DeepSpeed rank (see the module docstring).

    Args:
        config: TrainerConfig.
        model: a checkpoint directory (every rank loads it), a HybridMoEConfig (built with `config.seed` on every
            rank, so all start equal) or a model instance (world_size 1, or identical on every rank).
        rank, world_size, local_rank: this rank's place (local_rank defaults to rank).
        master_addr, master_port: rank 0's rendezvous address (port: a free one when world_size is 1).
    """

    def __init__(self, config: TrainerConfig, model: str | os.PathLike | HybridMoEConfig | HybridMoEForCausalLM, *,
                 rank: int = 0, world_size: int = 1, local_rank: int | None = None,
                 master_addr: str = "127.0.0.1", master_port: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if config.cuda_graph_tokens and not torch.cuda.is_available():  # the rest is checked with the config
            raise ValueError("trainer.cuda_graph_tokens needs a CUDA device, and this trainer would run on the CPU: "
                             "leave it empty")
        if master_port is None:
            if world_size > 1:
                raise ValueError("master_port is required with world_size > 1 (every rank must use the same one)")
            master_port = free_port()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.rank, self.world_size = rank, world_size
        # a checkpoint directory the policy came from: its tokenizer travels with every published version
        self.source_dir = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        self.backend = zero.init_process_group(rank=rank, world_size=world_size, master_addr=master_addr,
                                               master_port=master_port, timeout_s=config.dist_timeout_s,
                                               local_rank=rank if local_rank is None else local_rank)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else \
            torch.device("cpu")
        bf16 = config.dtype == "bf16" or (config.dtype == "auto" and self.device.type == "cuda")
        _seed_everything(config.seed)
        self.policy = _build_model(model, config.seed).float()
        if config.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.reference = None
        self.reference_reset = False  # reset_reference made it the policy of some step (saved beside the checkpoints)
        if config.loss.kl_coef > 0:
            ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
            ref = ref.to(device=self.device, dtype=torch.bfloat16 if bf16 else torch.float32)
            self.reference = PackedPolicy(ref, config.temperature)
        self.cp_size = config.context_parallel
        if world_size % self.cp_size:
            raise ValueError(f"context_parallel={self.cp_size} must divide world_size={world_size}")
        self.cp_rank, self.dp_rank, self.dp_size = rank % self.cp_size, rank // self.cp_size, world_size // self.cp_size
        self.cp_group = None
        if self.cp_size > 1:  # groups of consecutive ranks; every rank creates every group, in the same order
            for first in range(0, world_size, self.cp_size):
                group = dist.new_group(list(range(first, first + self.cp_size)))
                if first <= rank < first + self.cp_size:
                    self.cp_group = group
        self.ep_size = config.expert_parallel
        self.ep_stats = ExpertParallelStats()
        if self.ep_size > 1:
            self._shard_experts()
        self.module = PackedPolicy(self.policy, config.temperature)
        if config.zero_stage == 3:
            zero.prepare_zero3(self.module, self.policy)
        decay = [p for n, p in self.module.named_parameters() if p.ndim >= 2 and "_res_proj" not in n]
        no_decay = [p for n, p in self.module.named_parameters() if not (p.ndim >= 2 and "_res_proj" not in n)]
        param_groups = [{"params": decay, "weight_decay": config.weight_decay, "name": "decay"},
                        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
        if self.ep_size > 1:
            param_groups = zero.split_expert_param_groups(param_groups)
        self.optimizer = torch.optim.AdamW(param_groups, lr=config.lr, betas=config.betas, eps=config.adam_eps,
                                           **adamw_implementation(self.device))
        warmup = config.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        ds_config = zero.engine_config(zero_stage=config.zero_stage, bf16=bf16, grad_clip=config.grad_clip,
                                       zero3_param_persistence_threshold=config.zero3_param_persistence_threshold)
        self.engine = zero.initialize(self.module, self.optimizer, ds_config, scheduler)
        if config.cuda_graph_tokens:  # after DeepSpeed has placed the parameters: the graphs read them there
            self.module.graphs = GraphedForward(self.policy, config.cuda_graph_tokens, config.cuda_graph_sequences)
        self.global_step = 0
        self.version = 0  # policy version: training steps (batches) taken since the initial weights
        self._buckets: BucketRing | None = None  # rank 0's weight-sync buffers, kept from one sync to the next

    # --- training -------------------------------------------------------------------------------------------------
    def step(self, trajectories: Sequence[Trajectory], loss: LossConfig | None = None) -> dict[str, float]:
        """One training step on a batch (the same list on every rank); returns metrics summed over the ranks.

        The step makes `loss.mini_batches` optimizer steps (PPO mini-batches of whole groups; one by default) and
        counts as one policy version. `loss` overrides the configured objective for this step, e.g.
        LossConfig(kind="sft") for a warm start before RL with the same trainer (a KL term needs the configured
        loss to have kl_coef > 0: that is what builds the reference model).
        """
        start = time.perf_counter()
        self.ep_stats.reset()
        loss_cfg = self.config.loss if loss is None else loss
        if loss_cfg.kl_coef > 0 and self.reference is None:
            raise ValueError(f"this step asks for kl_coef={loss_cfg.kl_coef} but the trainer holds no reference "
                             f"model: set TrainerConfig.loss.kl_coef > 0 when constructing it")
        if loss_cfg.kind == "sft":
            advantages: list[float | None] = [0.0] * len(trajectories)
        else:
            advantages = grpo_advantages(trajectories, normalize_std=loss_cfg.normalize_adv_std)
        trajectories = self._maybe_without_routing(trajectories)
        plans = []
        for part in mini_batch_indices(trajectories, advantages, loss_cfg.mini_batches):
            plans.append(plan_step([trajectories[i] for i in part], [advantages[i] for i in part],
                                   world_size=self.dp_size, token_budget=self.config.micro_batch_tokens * self.cp_size,
                                   aggregation=loss_cfg.aggregation, norm_constant=loss_cfg.norm_constant,
                                   num_moe_layers=len(self.policy.moe_layers)))
        mine = [self._my_part(plan.per_rank[self.dp_rank]) for plan in plans]
        if len(plans) > 1 and loss_cfg.kind != "sft":
            self._record_old_logprobs([m for micros in mine for m in micros])
        self.engine.train()
        sums: Counter[str] = Counter()
        grad_norms, loads = [], {}
        skipped_before = self.engine.skipped_steps  # DeepSpeed skips a step whose gradient norm is not finite
        for plan, micros in zip(plans, mine):
            for micro, replay in zip(micros, self._replayable(plan), strict=True):
                with self.policy.balancers_observing(not micro.is_padding), self._graphs_allowing(replay):
                    out = micro_batch_loss(self.engine, micro, loss_cfg, reference=self.reference,
                                           device=self.device)
                with self.policy.balancers_observing(False):  # checkpointing's recomputation: seen in the forward
                    self.engine.backward(out.loss * self.world_size)
                sums.update(out.sums)
                sums["loss"] += out.loss.detach()  # on the device, like out.sums: read once, below
                sums["micro_batches"] += 1
                # every rank must sum the same keys: one whose micro-batches are all padding counts 0 tokens
                sums["packed_tokens"] += 0 if micro.is_padding else micro.num_tokens
            self.engine.step()
            grad_norm = self.engine.get_global_grad_norm()
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            loads = self.policy.update_expert_bias(all_reduce=zero.all_reduce_sum)
        self.global_step += 1
        self.version += 1
        seconds = time.perf_counter() - start
        if self.ep_size > 1:  # per-rank figures, averaged below
            sums.update({"ep/all_to_all_s": self.ep_stats.all_to_all_s,
                         "ep/count_exchange_s": self.ep_stats.count_exchange_s, "ep/step_s": seconds,
                         "ep/rows_sent": self.ep_stats.rows_sent, "ep/rows_kept": self.ep_stats.rows_kept})
        micro_batches = int(sums["micro_batches"])  # this rank's: equal on every rank
        totals = self._sum_over_ranks(sums)
        metrics = _loss_metrics(totals, loss_cfg)
        # each mini-batch's loss is a mean over its own sequences: the step's loss is their mean
        metrics.update(loss=metrics["loss"] / len(plans), pg_loss=metrics["pg_loss"] / len(plans))
        metrics.update(
            grad_norm=float(np.mean(grad_norms)), lr=float(self.engine.get_lr()[0]), step=self.global_step,
            version=self.version, optimizer_steps=len(plans), num_sequences=sum(p.num_sequences for p in plans),
            num_skipped=sum(len(p.skipped) for p in plans),
            optimizer_steps_skipped=self.engine.skipped_steps - skipped_before, micro_batches=micro_batches,
            packed_tokens=totals["packed_tokens"], step_s=seconds, tokens_per_s=totals["packed_tokens"] / seconds)
        if loads:
            metrics["expert_load_max_over_mean"] = max(loads.values())
            metrics.update({f"expert_load/{layer}": v for layer, v in loads.items()})
        if self.ep_size > 1:
            metrics.update(self._expert_parallel_metrics(totals))
        return metrics

    def _replayable(self, plan: StepPlan) -> list[bool]:
        """Per micro-batch of this rank, whether it may replay from a CUDA graph: where every data-parallel rank's
        micro-batch at its position fits one, so that the ranks reducing its gradients take the same path
        (cuda_graphs.GraphedForward)."""
        graphs = self.module.graphs
        if graphs is None:
            return [False] * len(plan.per_rank[self.dp_rank])
        return graphs.replayable(plan.per_rank)

    def _graphs_allowing(self, replay: bool):
        graphs = self.module.graphs
        return contextlib.nullcontext() if graphs is None else graphs.allowing(replay)

    def _my_part(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's micro-batches: its data-parallel group's, and under context parallelism its slice of each."""
        if self.cp_size == 1:
            return micro_batches
        return [context_slice(m, rank=self.cp_rank, size=self.cp_size, group=self.cp_group,
                              min_tokens=max(self.policy.config.kda_conv_size - 1, 1)) for m in micro_batches]

    @torch.no_grad()
    def _record_old_logprobs(self, micro_batches: Sequence[MicroBatch]) -> None:
        """π_old of a step with several optimizer steps: every micro-batch's target log-probs under the weights
        before the first one (a no-grad pass; collective like training)."""
        self.engine.eval()  # the routers observe only in training mode
        for micro in micro_batches:
            logp, _ = self.engine(*micro.forward_args(self.device))
            micro.old_logprobs_T = logp.float().cpu()
        self.engine.train()

    @torch.no_grad()
    def reset_reference(self) -> None:
        """The KL term's reference becomes the current policy. After a warm start RL's KL then anchors to the SFT
        policy, not to the weights the trainer was built with. Collective under ZeRO-3 (no-op without kl_coef)."""
        if self.reference is None:
            return
        reference = self.reference.policy  # sharded like the policy under expert parallelism: same local names
        ref_params = dict(reference.named_parameters())
        for name, p in zero.full_parameters(self.policy, zero_stage=self.config.zero_stage):
            ref_params[name].copy_(p.detach())
        ref_buffers = dict(reference.named_buffers())
        for name, b in self.policy.named_buffers():  # the routers' Quantile Balancing biases
            ref_buffers[name].copy_(b)
        self._save_reference()

    def _reference_file(self) -> str:
        """Where the reset reference lives (`<run_dir>/reference/`, beside the checkpoints): one file (every rank
        holds the whole reference) or one per rank (expert parallelism: each holds its experts)."""
        name = f"reference-rank{self.rank}.safetensors" if self.ep_size > 1 else "reference.safetensors"
        return os.path.join(self.config.run_dir, "reference", name)

    def _save_reference(self) -> None:
        """Writes the reference once it is no longer the initial weights, so that a run resumed from a later
        checkpoint anchors its KL term to the same policy (checkpoints record that it was reset). Collective."""
        from safetensors.torch import save_model

        if self.ep_size > 1 or self.rank == 0:
            path = self._reference_file()
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_model(self.reference.policy, path + ".tmp")
            os.replace(path + ".tmp", path)
        self.reference_reset = True
        dist.barrier()

    def set_lr(self, lr: float) -> None:
        """The base learning rate from the next step on (the warm-up factor still applies): SFT's, then RL's."""
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        scheduler = self.engine.lr_scheduler
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
        for group in scheduler.optimizer.param_groups:
            group["lr"] = lr * factor

    @torch.no_grad()
    def logprobs(self, trajectories: Sequence[Trajectory], *, routing_replay: bool = False) -> list[np.ndarray]:
        """The current policy's log-prob of each token given the previous ones (index 0 is 0.0), per trajectory.

        Collective under ZeRO-3 and expert parallelism (every rank computes all trajectories).
        """
        self.engine.eval()
        out: list[np.ndarray] = []
        for t in trajectories:
            t = t if routing_replay else _without_routing(t)
            micro = pack([t], [0], [0.0], [0.0])
            logp, _ = self.engine(*micro.forward_args(self.device))
            out.append(np.concatenate([[0.0], logp.float().cpu().numpy()]))
        self.engine.train()
        return out

    def info(self) -> dict[str, object]:
        """Where this rank stands (cheap; also tells a Ray driver that construction finished)."""
        sharded = expert_parameter_names(self.policy)
        total = sum(getattr(p, "ds_numel", p.numel()) * (self.ep_size if n in sharded else 1)  # full sizes
                    for n, p in self.policy.named_parameters())
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "device": str(self.device), "zero_stage": self.config.zero_stage, "step": self.global_step,
                "version": self.version, "parameters": total, "expert_parallel": self.ep_size}

    def replica_checksum(self) -> str:
        """sha256 of this rank's full weights and buffers (QB biases included): equal on every rank. Collective."""
        full = gather_full_experts(self.policy, dst=None) if self.ep_size > 1 else None
        return zero.replica_digest(self.policy, zero_stage=self.config.zero_stage, replace=full)

    # --- weights and checkpoints ----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy's full state dict (training layout, CPU) on rank 0; None on the others. Collective."""
        state = zero.gather_state_dict(self.policy, zero_stage=self.config.zero_stage, rank=self.rank)
        if self.ep_size > 1 and self.rank < self.ep_size:  # rank 0's expert-parallel group gathers the experts
            experts = gather_full_experts(self.policy, dst=0)
            if state is not None:
                state.update(experts)
        return state

    def publish_weights(self) -> PublishedWeights:
        """Writes the current weights to `<run_dir>/weights/v{version}`; every rank returns the same record."""
        start = time.perf_counter()
        state = self.full_state_dict()
        gather_s = time.perf_counter() - start
        record: list = [None]
        if self.rank == 0:
            try:
                record[0] = write_weights(state, self.policy.config, self.config.run_dir, self.version,
                                          keep_last=self.config.keep_weight_versions, gather_s=gather_s,
                                          tokenizer_dir=self.source_dir)
            except Exception as e:  # the other ranks wait in the broadcast: tell them, then fail everywhere
                record[0] = e
        dist.broadcast_object_list(record, src=0)
        if isinstance(record[0], Exception):
            raise RuntimeError(f"rank 0 failed to publish weights v{self.version}") from record[0]
        return record[0]

    def sync_weights(self, receivers: Receivers | None, bucket_bytes: int = 1 << 30,
                     dtype: str | None = None) -> SyncRecord:
        """Streams the current weights to `receivers` in memory as this version (trainer/weight_stream.py): every
        rank takes part in the gathers, rank 0 sends (the others may pass None) and returns the record. Buckets go
        through /dev/shm on CPU and CUDA IPC on GPU, in `dtype` (default: the engines' — `rollout.engine.dtype`
        is what the driver's receivers load)."""
        ring = None
        if self.rank == 0:
            if self._buckets is None or self._buckets.capacity != bucket_bytes:
                if self._buckets is not None:
                    self._buckets.close()
                self._buckets = BucketRing.create("cuda_ipc" if self.device.type == "cuda" else "shm", bucket_bytes,
                                                  device=self.device)
            ring = self._buckets
        return stream_weights(self.policy, receivers if self.rank == 0 else None, version=self.version,
                              zero_stage=self.config.zero_stage, rank=self.rank, ring=ring,
                              dtype=getattr(torch, dtype) if dtype else None)

    def save_checkpoint(self, client_state: dict | None = None) -> str:
        """Saves model, optimizer, QB biases (model buffers), step, version, RNG states and `client_state` (e.g.
        {"store_position": store.position}) under `<run_dir>/checkpoints/step{N}`; returns that directory."""
        root = os.path.join(self.config.run_dir, CHECKPOINT_DIR)
        tag = f"step{self.global_step}"
        state = dict(client_state or {}, global_step=self.global_step, version=self.version,
                     reference_reset=self.reference_reset)
        # RNG first: DeepSpeed writes `latest` at the end of its save, so a crash never leaves a latest without it
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        torch.save(_rng_state(), os.path.join(root, tag, f"rng_rank{self.rank}.pt"))
        self.engine.save_checkpoint(root, tag=tag, client_state={"agentrl": state})
        if self.ep_size > 1:  # DeepSpeed's module file holds rank 0's experts only
            save_model_shards(self.policy, self.policy.config, os.path.join(root, tag, MODEL_DIR), rank=self.rank,
                              ep_size=self.ep_size)
        dist.barrier()
        if self.rank == 0:
            prune_checkpoints(root, keep=self.config.keep_checkpoints)
        return os.path.join(root, tag)

    def load_checkpoint(self, path: str | None = None) -> dict:
        """Restores a checkpoint (default: the latest under `<run_dir>/checkpoints`); returns its client state."""
        if path is None:
            root, tag = os.path.join(self.config.run_dir, CHECKPOINT_DIR), None
        else:
            root, tag = os.path.split(os.path.normpath(path))
        if tag is None and os.path.exists(os.path.join(root, "latest")):
            tag = _read_latest(root)
        if tag is not None and os.path.isdir(os.path.join(root, tag)) and \
                (saved_ep := saved_expert_parallel(os.path.join(root, tag))) != self.ep_size:
            raise ValueError(f"the checkpoint {os.path.join(root, tag)} was saved with expert_parallel={saved_ep}, "
                             f"this trainer has {self.ep_size}: resume with the same degree, or start a new trainer "
                             f"from its weights (`<checkpoint>/{MODEL_DIR}` when saved with expert parallelism)")
        loaded, client = self.engine.load_checkpoint(root, tag=tag)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint at {path or root}")
        keep_adamw_implementation(self.optimizer, self.device)
        state = dict(client["agentrl"])
        self.global_step, self.version = state["global_step"], state["version"]
        if self.ep_size > 1:  # DeepSpeed loaded rank 0's experts into every rank; ZeRO's fp32 copies are right
            load_local_experts(self.policy, os.path.join(root, tag, MODEL_DIR))
        rng_file = os.path.join(root, tag, f"rng_rank{self.rank}.pt")
        _set_rng_state(torch.load(rng_file, weights_only=False))
        if state.get("reference_reset") and self.reference is not None:  # the KL anchor the run had
            from safetensors.torch import load_model

            load_model(self.reference.policy, self._reference_file())
            self.reference_reset = True
        return state

    def roll_back(self) -> dict:
        """Restores the newest checkpoint saved before the current weights' last update (model, optimizer state, QB
        biases) and returns its client state; the step and version count on, so the restored weights are the next
        policy version for the engines. The driver's undo of an update that stalled the run (agentrl/stall.py)."""
        root = os.path.join(self.config.run_dir, CHECKPOINT_DIR)
        older = [n for n in checkpoint_steps(root) if n < self.global_step]
        if not older:
            raise FileNotFoundError(f"no checkpoint under {root} from before step {self.global_step} to roll back to "
                                    f"(trainer.keep_checkpoints={self.config.keep_checkpoints} keeps too few)")
        global_step, version = self.global_step, self.version
        state = self.load_checkpoint(os.path.join(root, f"step{max(older)}"))
        self.global_step, self.version = global_step, version + 1
        return state

    def close(self) -> None:
        """Leaves the process group (the engine is unusable afterwards) and frees the weight-sync buffers and the
        CUDA graphs (each holds its bucket's activations)."""
        if self._buckets is not None:
            self._buckets.close()
            self._buckets = None
        self.module.graphs = None
        zero.destroy_process_group()

    # --- internals ------------------------------------------------------------------------------------------------
    def _shard_experts(self) -> None:
        num_experts = self.policy.config.num_experts
        if self.world_size % self.ep_size or num_experts % self.ep_size:
            raise ValueError(f"expert_parallel={self.ep_size} must divide the number of ranks ({self.world_size}) "
                             f"and of routed experts ({num_experts})")
        group, group_name = zero.expert_parallel_group(self.ep_size)
        apply_expert_parallel(self.policy, group, self.ep_stats)
        if self.reference is not None:
            apply_expert_parallel(self.reference.policy, group, self.ep_stats)
        zero.mark_expert_parameters([p for n, p in self.policy.named_parameters()
                                     if n in expert_parameter_names(self.policy)], group_name)

    def _expert_parallel_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """All-to-all time (rank mean) and its share of the step; token rows that crossed ranks; the Quantile
        Balancing load of each expert-parallel rank (its experts' tokens) as max/mean, worst layer."""
        n = self.world_size
        rows = totals["ep/rows_sent"] + totals["ep/rows_kept"]
        metrics = {"ep/all_to_all_s": totals["ep/all_to_all_s"] / n,
                   "ep/count_exchange_s": totals["ep/count_exchange_s"] / n,
                   "ep/all_to_all_share": totals["ep/all_to_all_s"] / max(totals["ep/step_s"], 1e-12),
                   "ep/rows_sent_frac": totals["ep/rows_sent"] / rows if rows else 0.0}
        rank_loads = [moe.gate.balancer.last_stats.load_E.view(self.ep_size, -1).sum(1)
                      for moe in self.policy.moe_layers if moe.gate.balancer.last_stats is not None]
        ratios = [float(x.max() / x.mean()) for x in rank_loads if x.sum() > 0]
        if ratios:
            metrics["ep/rank_load_max_over_mean"] = max(ratios)
        return metrics

    def _maybe_without_routing(self, trajectories: Sequence[Trajectory]) -> Sequence[Trajectory]:
        if self.config.routing_replay:
            return trajectories
        return [_without_routing(t) for t in trajectories]

    def _sum_over_ranks(self, sums: Counter[str]) -> dict[str, float]:
        keys = sorted(sums)
        local = read_sums(sums)  # the device's sums in one transfer
        values = torch.tensor([local[k] for k in keys], dtype=torch.float64)
        zero.all_reduce_sum(values)
        return dict(zip(keys, values.tolist()))


def adamw_implementation(device: torch.device) -> dict:
    """The AdamW kernel for this machine's device: fused on a GPU, torch's default elsewhere.

    ZeRO hands the optimizer one flat fp32 partition per parameter group, and torch's default on CUDA (foreach)
    computes sqrt(v) of it into a temporary as large as the partition, 4 bytes a parameter: the step of a 2.7B model
    ran out of an H100's memory on it (docs/benchmarks.md). The fused kernel keeps no temporaries."""
    return {"fused": True} if device.type == "cuda" else {}


def keep_adamw_implementation(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """After a checkpoint is loaded: the kernel this machine runs, not the saving machine's.

    torch's `load_state_dict` takes every group option from the checkpoint, the kernel flags among them, so a run
    saved on CPU (or before the trainer chose the fused kernel) would resume on a GPU with the foreach step and its
    temporary, and one saved on a GPU would bring `fused` to wherever it resumes. The flags are set again here, and
    each step count put where that kernel reads it: on the parameter's device in fp32 for the fused kernel, on the
    host for the others (torch's own layouts; elsewhere a CPU-kept count would reach a GPU kernel)."""
    for group in optimizer.param_groups:
        group.update({"fused": None, "foreach": None, **adamw_implementation(device)})  # None: torch's default
        on_device = bool(group["fused"] or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(dtype=torch.float32, device=p.device if on_device else "cpu")


def _loss_metrics(totals: dict[str, float], config: LossConfig) -> dict[str, float]:
    tokens = max(totals.get("tokens", 0.0), 1.0)
    metrics = {"loss": totals["loss"], "pg_loss": totals["pg_loss"], "trained_tokens": totals.get("tokens", 0.0)}
    per_token = {"entropy": "entropy", "kl": "kl", "nll": "nll", "ratio_mean": "ratio",
                 "tis_truncated_frac": "tis_truncated", "icepop_masked_frac": "icepop_masked",
                 "train_infer_abs_logp_diff": "train_infer_abs_logp_diff", "clip_frac": "clipped"}
    for name, key in per_token.items():
        if key in totals:
            metrics[name] = totals[key] / tokens
    if config.kind == "gspo":
        seqs = max(totals.get("sequences", 0.0), 1.0)
        metrics["clip_frac"] = totals["clipped_seqs"] / seqs
        metrics["seq_ratio_mean"] = totals["seq_ratio"] / seqs
    return metrics


def _build_model(model, seed: int) -> HybridMoEForCausalLM:
    if isinstance(model, HybridMoEForCausalLM):
        return model
    if isinstance(model, HybridMoEConfig):
        torch.manual_seed(seed)
        return HybridMoEForCausalLM(model)
    if isinstance(model, (str, os.PathLike)):
        return HybridMoEForCausalLM.from_pretrained(os.fspath(model))
    raise ValueError(f"model must be a checkpoint path, a HybridMoEConfig or a HybridMoEForCausalLM, "
                     f"got {type(model).__name__}")


def _without_routing(t: Trajectory) -> Trajectory:
    if t.routed_experts is None:
        return t
    t = copy.copy(t)
    t.routed_experts = None
    return t


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def prune_checkpoints(root: str, *, keep: int) -> list[str]:
    """Deletes all but the newest `keep` `step{N}` checkpoints under `root` (never the one `latest` names); returns the
    deleted directories. Called after every rank has finished its save, so the newest is complete."""
    import shutil

    steps = [f"step{n}" for n in checkpoint_steps(root)]
    latest = _read_latest(root) if os.path.exists(os.path.join(root, "latest")) else None
    deleted = []
    for name in steps[:-keep]:
        if name != latest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            deleted.append(os.path.join(root, name))
    return deleted


def checkpoint_steps(root: str) -> list[int]:
    """The steps N of the `step{N}` checkpoint directories under `root`, in increasing order."""
    if not os.path.isdir(root):
        return []
    return sorted(int(name[4:]) for name in os.listdir(root)
                  if name.startswith("step") and name[4:].isdigit() and os.path.isdir(os.path.join(root, name)))


def _read_latest(root: str) -> str:
    with open(os.path.join(root, "latest")) as f:
        return f.read().strip()
