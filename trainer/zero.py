"""DeepSpeed plumbing: the process group, the engine config, ZeRO-3 module hooks, and gathering full weights.

The only module of agentrl that imports DeepSpeed (the trainer imports it from here). On a machine without CUDA it
selects DeepSpeed's CPU accelerator, gloo, and skips the shared-memory comm op whose first build takes ~80 s.

ZeRO-3 gathers a module's own parameters when that module's forward runs. Three kinds of access escape that rule in
the hybrid model and are registered here:
- the MoE block (`SparseMoE`) indexes expert weights by routing, which differs between ranks: as a *leaf* module its
  parameters are gathered as one unit, so every rank issues the same collectives (without this, ranks that route
  differently deadlock);
- KDA reads its short-convolution and output-norm weights directly (`self.q_conv1d.weight`), and KDA, MLA and the
  dense MLP read their projections' weights to run them as one GEMM (`layers.linear_many`): leaf modules too, whose
  children DeepSpeed then neither hooks nor gathers one by one (fewer hooks per step; without it DeepSpeed found
  those weights only on access, gathering each alone the first time);
- Block AttnRes mixes read the norm and query weights in the decoder's forward, and the chunked log-prob head reads
  `lm_head.weight` in the wrapper's forward: *external parameters* of the module whose forward reads them.

Expert parallelism (ZeRO-2 only) uses DeepSpeed's own MoE machinery, as its `MoE` layer does: the expert-parallel
and expert-data-parallel groups come from `deepspeed.utils.groups` (named `ep_size_{N}`), the sharded expert
parameters carry `allreduce = False` and `group_name`, and the optimizer's parameter groups are split with
`split_params_into_different_moe_groups_for_optimizer`. ZeRO-2 then reduces expert gradients over the
expert-data-parallel group only (dividing by the full data-parallel size, which is right: each expert's gradient
already sums the contributions of the tokens of every rank in its expert-parallel group) and partitions their
optimizer state there. DeepSpeed recognises an MoE model only by its own layer classes, so `initialize` builds an
engine that declares the model MoE when expert parameters are marked.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm  # noqa: E402
import deepspeed.ops  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.runtime.zero import partition_parameters  # noqa: E402
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3  # noqa: E402
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # noqa: E402
from deepspeed.runtime.zero.utils import get_norm_dtype  # noqa: E402
from deepspeed.utils import groups, set_z3_leaf_modules  # noqa: E402

from agentrl.model.kda import KimiDeltaAttention  # noqa: E402
from agentrl.model.layers import MLP  # noqa: E402
from agentrl.model.mla import GatedMLA  # noqa: E402
from agentrl.model.moe import SparseMoE  # noqa: E402
from agentrl.trainer.host_copy import to_host  # noqa: E402

Z3_LEAF_MODULES = (SparseMoE, KimiDeltaAttention, GatedMLA, MLP)


def init_process_group(*, rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int,
                       timeout_s: float) -> str:
    """Sets the rendezvous variables DeepSpeed reads and joins the group; returns the backend."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        torch.cuda.set_device(local_rank)
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) already exists; "
                             f"cannot join as rank {rank} of {world_size}")
        return dist.get_backend()
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def destroy_process_group() -> None:
    """Leaves the group through DeepSpeed, which also drops the groups it cached (a later trainer in the same process
    would otherwise broadcast over a destroyed group)."""
    if dist.is_initialized():
        dist.barrier()
        deepspeed.comm.destroy_process_group()


def engine_config(*, zero_stage: int, bf16: bool, grad_clip: float, zero3_param_persistence_threshold: int) -> dict:
    """The DeepSpeed config: one backward per micro-batch, the caller owns the step (unmanaged accumulation).

    On a GPU, ZeRO-2 overlaps its gradient reduction with the backward (`overlap_comm`, DeepSpeed's default only for
    ZeRO-3): without it the reduction runs parameter by parameter after the backward, on the compute stream, and the
    `small` preset's step on one H200 took 304 ms against 217 ms with it at 4K tokens (docs/benchmarks.md, "Where
    DeepSpeed's time goes"). The CPU accelerator has no side streams to overlap on.
    """
    zero: dict = {"stage": zero_stage}
    if zero_stage == 2 and torch.cuda.is_available():
        zero["overlap_comm"] = True
    if zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=zero3_param_persistence_threshold,
                    # DeepSpeed would otherwise replace torch.nn.functional.linear process-wide
                    memory_efficient_linear=False)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # micro-batches per step vary with the token budget
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def prepare_zero3(wrapper: nn.Module, policy: nn.Module) -> None:
    """Registers the hybrid model's leaf modules and external parameters (see the module docstring)."""
    set_z3_leaf_modules(wrapper, list(Z3_LEAF_MODULES))
    deepspeed.zero.register_external_parameter(wrapper, policy.lm_head.weight)
    for name, param in policy.model.named_parameters():
        if "_res_norm." in name or "_res_proj." in name:
            deepspeed.zero.register_external_parameter(policy.model, param)


def expert_parallel_group(size: int):
    """(the expert-parallel process group of this rank, its DeepSpeed group name), creating DeepSpeed's expert and
    expert-data-parallel groups on first use: ranks [0, N), [N, 2N), ... exchange tokens; ranks with the same
    position in their expert-parallel group hold the same experts and average their gradients."""
    name = f"ep_size_{size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size)
    return groups._get_expert_parallel_group(name), name


def mark_expert_parameters(params, group_name: str) -> None:
    """Marks parameters as expert shards the way DeepSpeed's `Experts` does (no all-reduce over data parallelism;
    averaged over the expert-data-parallel group `group_name`)."""
    for p in params:
        p.allreduce = False
        p.group_name = group_name


def split_expert_param_groups(param_groups: list[dict]) -> list[dict]:
    """Optimizer parameter groups with the marked expert parameters moved into DeepSpeed MoE groups."""
    return split_params_into_different_moe_groups_for_optimizer(param_groups)


class _ExpertParallelEngine(DeepSpeedEngine):
    """A DeepSpeedEngine that treats a model with marked expert parameters as an MoE model (see the docstring)."""

    def _configure_distributed_model(self, model):
        super()._configure_distributed_model(model)
        self.has_moe_layers = self.has_moe_layers or any(is_moe_param(p) for p in model.parameters())


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict, lr_scheduler=None):
    expert_parallel = any(is_moe_param(p) for p in model.parameters())
    engine_class = deepspeed.DeepSpeedEngine
    if expert_parallel:  # deepspeed.initialize names the engine class it builds from its module's globals
        deepspeed.DeepSpeedEngine = _ExpertParallelEngine
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                               lr_scheduler=lr_scheduler)
    finally:
        deepspeed.DeepSpeedEngine = engine_class
    _check_overflow_by_the_norm(engine.optimizer)
    _norm_in_one_pass(engine.optimizer)
    _overflow_read_after_the_step(engine.optimizer)
    _epilogue_without_a_host_wait(engine.optimizer)
    _unsharded_fetches_without_a_host_wait(engine.optimizer)
    return engine


def _check_overflow_by_the_norm(optimizer) -> None:
    """ZeRO-1/2: the global gradient norm, which the step computes anyway, is the overflow check. DeepSpeed first
    tests every gradient partition for inf/NaN one tensor at a time (for the `small` preset 430 small kernels and an
    all-reduce with a host sync), then computes the norm and, for bf16 only while that check is on, skips the step
    if the norm is not finite. A NaN or inf anywhere makes the norm non-finite, so the first test adds nothing but
    host time: the `small` preset's 4K-token ZeRO-2 step on an H200 took 239 ms with it and 207 ms without
    (docs/benchmarks.md, "The DeepSpeed step against the bare one"). The flag stays on, so the norm's test still
    runs; only the per-tensor pass is dropped (with torch's fused Adam the norm's test moves to the device:
    `_overflow_read_after_the_step`). (fp32 steps test the norm whatever the flag; ZeRO-3 always does, and its
    per-tensor pass measured no cost worth a change.)"""
    if (isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.compute_grad_norm
            and optimizer.check_grad_overflow and not optimizer.cpu_offload):
        optimizer.check_overflow = _norm_checks_overflow


def _norm_checks_overflow(partition_gradients: bool = True) -> None:
    """Stands in for DeepSpeedZeroOptimizer.check_overflow (see _check_overflow_by_the_norm): leaves `overflow`
    False for the norm's test to set."""
    del partition_gradients


def _overflow_read_after_the_step(optimizer) -> None:
    """ZeRO-1/2 in bf16 with torch's fused Adam: a step whose gradient norm is not finite is skipped on the device, and
    the host reads that it was once the whole step is queued.

    DeepSpeed decides the skip on the host, and its step waited for the GPU seven times (the `small` preset, two
    parameter groups: twice in each group's norm for its masking helper, once to test the global norm, once more in
    the clip of each group); each wait leaves the GPU idle while the host then queues the next part (the copy to
    fp32, the clip, Adam, the copy back to bf16), one launch after another. Here the norm's test is a device tensor
    handed to the fused kernel as `found_inf`, the argument torch's GradScaler uses: where it is set the kernel
    leaves weights, moments and step counts as they were. The clip takes the norm on the device too (a norm that is
    not finite clips by infinity, as DeepSpeed's). After the step is queued its one read sets `overflow`, which the
    engine uses as it does DeepSpeed's own: the step is counted as skipped and the learning-rate schedule does not
    advance. (The backward's end waited for the GPU too: `_epilogue_without_a_host_wait`.) The other Adam kernels take
    no `found_inf`: they keep DeepSpeed's host decision."""
    base = getattr(optimizer, "optimizer", None)
    if not (isinstance(optimizer, DeepSpeedZeroOptimizer) and not optimizer.cpu_offload
            and optimizer.compute_grad_norm and optimizer.check_grad_overflow and optimizer.dtype == torch.bfloat16
            and isinstance(base, torch.optim.Adam) and all(g.get("fused") for g in base.param_groups)):
        return
    optimizer.check_grad_overflow = False  # no host test of the norm inside DeepSpeed's step
    norm, clip, step = optimizer.scaled_global_norm, optimizer.unscale_and_clip_grads, optimizer.step

    def invalid(total: torch.Tensor) -> torch.Tensor:  # DeepSpeed's invalid norms: its -1 marker, inf, NaN
        return ~torch.isfinite(total) | (total < 0)

    def norm_and_found_inf(norm_type=2):
        total = norm(norm_type)
        base.found_inf = invalid(total).float()
        return total

    def clip_on_the_device(grad_groups_flat, total_norm):
        if not torch.is_tensor(total_norm) or optimizer.clip_grad <= 0.0:
            return clip(grad_groups_flat, total_norm)
        clip_norm = total_norm.masked_fill(invalid(total_norm), float("inf"))
        scale = torch.clamp((clip_norm / optimizer.loss_scale + 1e-6) / optimizer.clip_grad, min=1.0)
        factor = 1.0 / (scale * optimizer.loss_scale)
        for grad in grad_groups_flat:
            for g in grad if isinstance(grad, list) else [grad]:
                g.data.mul_(factor)

    def step_then_read_overflow(closure=None):
        base.found_inf = None
        try:
            step(closure)
            if base.found_inf is not None:
                optimizer.overflow = bool(base.found_inf)  # the step's one host read, after all of it is queued
        finally:
            base.found_inf = None

    optimizer.scaled_global_norm = norm_and_found_inf
    optimizer.unscale_and_clip_grads = clip_on_the_device
    optimizer.step = step_then_read_overflow


def _epilogue_without_a_host_wait(optimizer) -> None:
    """The end of each backward orders the GPU's streams instead of holding the host until the GPU is idle.

    With `overlap_comm` the gradient reduction runs on a side stream, and its last bucket is queued there in the
    backward's epilogue, with the copies of the reduced gradients into the flat partition the optimizer reads. The
    epilogue then waits for it on the host (ZeRO-1/2 synchronizes the whole device, ZeRO-3 the side stream) before
    it drops the references to the reduced gradients. No host code reads those gradients: what the wait orders is
    GPU work, the optimizer's kernels and the next micro-batch's use of the freed memory, all queued on the compute
    stream. Making the compute stream wait for the side stream (an event, no host wait) orders the same, and the
    caching allocator hands memory freed on one stream to its own stream's later work only. The host can then queue
    the optimizer step (or the next micro-batch's forward) while the GPU still runs the backward's tail: without it,
    the GPU ran dry at every backward's end and stayed idle while the host worked through the step's Python.
    Stands in for the wait only inside the epilogue, only on CUDA (elsewhere DeepSpeed skips it: its CPU accelerator
    resolves the dependency itself)."""
    if not torch.cuda.is_available() or get_accelerator().resolves_data_dependency():
        return
    if isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.overlap_comm and not optimizer.cpu_offload:
        side, waits = optimizer.reduction_stream, get_accelerator()  # DeepSpeed: get_accelerator().synchronize()
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and not optimizer.offload_optimizer:
        side = waits = optimizer.reduce_and_partition_stream  # DeepSpeed: reduce_and_partition_stream.synchronize()
    else:
        return
    epilogue = optimizer.independent_gradient_partition_epilogue

    def epilogue_ordered_on_the_gpu():
        with _shadowed(waits, "synchronize", lambda *device: torch.cuda.current_stream().wait_stream(side)):
            epilogue()

    optimizer.independent_gradient_partition_epilogue = epilogue_ordered_on_the_gpu


def _unsharded_fetches_without_a_host_wait(optimizer) -> None:
    """ZeRO-3 over a partition group of one rank fetches a module's parameters without gathering: the partition is
    the whole tensor, already on the GPU, and the parameter takes it as its data (DeepSpeed's `NoGatherHandle`s; a
    `.to()` of a tensor already on its device is the tensor itself). Yet DeepSpeed held the host until the GPU had
    run everything queued at every module whose parameters are sharded, in the forward, its recomputation and the
    backward, twice over: each such fetch's wait synchronized the compute stream, and the fetch then recorded an
    event per parameter and, past two in flight, waited on the host for the oldest (a bound on the memory that
    gathers in flight hold; a module of four or more parameters reached it at once, on events just recorded).
    Nothing was in flight and nothing was allocated. So a fetch that made no copy does not synchronize (the wait is
    kept where a partition lives elsewhere, offloaded or quantized: there the fetch copies), and with a partition
    group of one rank, where no fetch allocates, the fetch events do not bound the host. The handles are
    DeepSpeed's classes, changed process-wide (DeepSpeed's own wait kept as the new method's `deepspeed_wait`)."""
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return

    def on_this_device(params) -> bool:
        here = torch.device(get_accelerator().current_device_name())
        return all(p.ds_tensor.device == here and not hasattr(p.ds_tensor, "ds_quant_scale") for p in params)

    for handle_class, params_of in (
            (partition_parameters.NoGatherHandle, lambda h: [h._NoGatherHandle__param]),
            (partition_parameters.NoGatherCoalescedHandle, lambda h: h._NoGatherCoalescedHandle__params)):
        if hasattr(handle_class.wait, "deepspeed_wait"):
            continue

        def wait(self, *, _wait=handle_class.wait, _params_of=params_of, **kwargs) -> None:
            if not on_this_device(_params_of(self)):
                return _wait(self, **kwargs)
            # DeepSpeed's wait syncs unless the accelerator orders the data itself
            with _shadowed(get_accelerator(), "resolves_data_dependency", lambda: True):
                return _wait(self, **kwargs)

        wait.deepspeed_wait = handle_class.wait
        handle_class.wait = wait
    if dist.get_world_size(group=optimizer.dp_process_group) == 1:
        coordinator = optimizer.parameter_offload.get_param_coordinator()
        coordinator._PartitionedParameterCoordinator__max_ongoing_fetch_events = sys.maxsize


@contextlib.contextmanager
def _shadowed(obj, name: str, value):
    """`obj.name` is `value` inside the block (an instance attribute over the class's method), as before after it."""
    missing = object()
    before = obj.__dict__.get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


def _norm_in_one_pass(optimizer) -> None:
    """The global gradient norm from one multi-tensor kernel instead of one norm per gradient (ZeRO-1/2 and 3).

    DeepSpeed's `get_grad_norm_direct` copies each gradient to fp64 and takes its norm, two or three ops per tensor
    (~650 launches for the `small` preset's 215 parameters under ZeRO-2, 430 under ZeRO-3) in a step that is
    host-bound at short lengths. `torch._foreach_norm` gives the same per-tensor norms, accumulated in the same
    dtype, from a few launches; what follows (the sum of squares, the all-reduces, the root, non-finite masked to -1)
    is DeepSpeed's. Parameters that DeepSpeed would skip or count specially (pipeline-replicated ones, tensor- or
    model-parallel ranks, AutoEP experts) never occur in agentrl; if they did, its own method runs."""
    if isinstance(optimizer, DeepSpeedZeroOptimizer) and not optimizer.cpu_offload:
        per_tensor = optimizer.get_grad_norm_direct
        optimizer.get_grad_norm_direct = lambda gradients, params, norm_type=2: _global_grad_norm(
            optimizer, per_tensor, gradients, params, norm_type)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and not optimizer.offload_optimizer:
        per_tensor = optimizer.get_grad_norm_direct
        optimizer.get_grad_norm_direct = lambda gradients, params, norm_type=2: _global_grad_norm_stage3(
            optimizer, per_tensor, gradients, params, norm_type)


def _sum_of_squared_norms(gradients) -> torch.Tensor | None:
    """Σ‖g‖² over the gradients in get_norm_dtype() (each norm accumulated in that dtype, as DeepSpeed's), on this
    rank's device; None for no gradients."""
    norm_dtype = get_norm_dtype()
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in gradients:  # the multi-tensor kernel takes one device and dtype per call
        by_kind.setdefault((g.device, g.dtype), []).append(g.detach())
    device = torch.device(get_accelerator().current_device_name())
    squares = [torch.stack(torch._foreach_norm(group, 2, dtype=norm_dtype)).square().sum().to(device)
               for group in by_kind.values()]
    return torch.stack(squares).sum() if squares else None


def _global_grad_norm(optimizer, per_tensor, gradients, params, norm_type=2) -> torch.Tensor:
    params = list(params)
    if (float(norm_type) != 2.0 or optimizer.model_parallel_rank != 0
            or any(getattr(p, "ds_pipe_replicated", False) for p in params)):
        return per_tensor(gradients, params, norm_type)
    squares = _sum_of_squared_norms([g for g in gradients if not getattr(g, "_zero_padding", False)])
    device = torch.device(get_accelerator().current_device_name())
    total = squares.float() if squares is not None else torch.zeros((), dtype=torch.float32, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
    optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    return _invalid_as_minus_one(total.sqrt())


def _global_grad_norm_stage3(optimizer, per_tensor, gradients, params, norm_type=2) -> torch.Tensor:
    """ZeRO-3's `get_grad_norm_direct` for the 2-norm without tensor parallelism or AutoEP: each rank's partitions
    all count, summed over the partition group, the root taken as DeepSpeed takes it (`** 0.5`, in the norm dtype),
    -1 for a non-finite norm."""
    params = list(params)
    if (float(norm_type) != 2.0 or not params or optimizer.model_parallel_group is not None
            or optimizer.model_parallel_rank != 0 or optimizer._autoep_expert_parallel_group(params) is not None):
        return per_tensor(gradients, params, norm_type)
    optimizer._assert_same_partition_group(params)
    total = _sum_of_squared_norms(gradients)
    if total is None:
        return per_tensor(gradients, params, norm_type)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer._get_param_partition_group(params[0]))
    optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    return _invalid_as_minus_one(total ** 0.5)


def _invalid_as_minus_one(norm: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's marking of a norm that is not finite (-1, in place), without its helper's two host syncs (it copies
    the -1 from the host, then fills with that tensor)."""
    return norm.masked_fill_(~torch.isfinite(norm), -1.0)


def _group_key(name: str) -> str:
    """The decoder layer a tensor belongs to (`model.layers.3`), else its top-level module (embeddings, the rest)."""
    parts = name.split(".")
    return ".".join(parts[:parts.index("layers") + 2]) if "layers" in parts else parts[0]


def _param_groups(module: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """Parameters grouped by decoder layer (embeddings, each layer, the rest) to bound what one gather holds."""
    groups: OrderedDict[str, list] = OrderedDict()
    for name, param in module.named_parameters():
        groups.setdefault(_group_key(name), []).append((name, param))
    return list(groups.values())


def full_parameters(module: nn.Module, *, zero_stage: int) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) with the full value readable while it is yielded: under ZeRO-3 one decoder layer is gathered
    at a time, on every rank. Collective under ZeRO-3: every rank must run through it to the end."""
    for group in _param_groups(module):
        with _gathered(group, zero_stage):
            yield from group


def _gathered(group: list[tuple[str, nn.Parameter]], zero_stage: int):
    """Under ZeRO-3 the group's full parameters, readable inside the context (collective); else nothing to do."""
    if zero_stage == 3:
        return deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None)
    return contextlib.nullcontext()


def state_groups(module: nn.Module, *, zero_stage: int, rank: int) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The module's state dict one decoder layer at a time (embeddings, each layer, the rest; persistent buffers
    with their layer) as (group key, tensors): e.g. ("model.layers.3", {...}). Full values are readable on rank 0
    while each group is yielded (other ranks get the key and {}). Collective
    under ZeRO-3: every rank runs through it to the end. The tensors are the live ones (ZeRO-3: gathered, and
    released after the group): copy what must outlive the group."""
    state = module.state_dict(keep_vars=True)
    groups: OrderedDict[str, list[str]] = OrderedDict()
    for name in state:
        groups.setdefault(_group_key(name), []).append(name)
    for key, names in groups.items():
        params = {id(state[n]): (n, state[n]) for n in names if isinstance(state[n], nn.Parameter)}  # tied: once
        with _gathered(list(params.values()), zero_stage):
            yield key, {n: state[n].detach() for n in names} if rank == 0 else {}


def gather_state_dict(module: nn.Module, *, zero_stage: int, rank: int) -> dict[str, torch.Tensor] | None:
    """The module's full state dict on CPU on rank 0 (None elsewhere), in state-dict order. Collective under ZeRO-3:
    every rank calls. Gathered one decoder layer at a time (`state_groups`), each copied out in one transfer."""
    if zero_stage < 3:
        return to_host(module.state_dict()) if rank == 0 else None
    out: dict[str, torch.Tensor] = {}
    for _, group in state_groups(module, zero_stage=zero_stage, rank=rank):
        out.update(to_host(group))
    if rank != 0:
        return None
    keys = list(module.state_dict(keep_vars=True).keys())
    return {k: out[k] for k in keys}


def replica_digest(module: nn.Module, *, zero_stage: int, replace: dict[str, torch.Tensor] | None = None) -> str:
    """sha256 of this rank's view of every parameter (gathered under ZeRO-3) and buffer. Collective under ZeRO-3.

    `replace` substitutes parameters by name (the gathered full experts under expert parallelism)."""
    digest = hashlib.sha256()
    replace = replace or {}
    for name, p in full_parameters(module, zero_stage=zero_stage):
        digest.update(name.encode())
        digest.update(replace.get(name, p).detach().float().cpu().numpy().tobytes())
    for name, b in module.named_buffers():
        digest.update(name.encode())
        digest.update(b.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sums a tensor over the ranks in place (moved to the backend's device when needed)."""
    if dist.get_backend() == "nccl" and not tensor.is_cuda:
        moved = tensor.cuda()
        dist.all_reduce(moved)
        tensor.copy_(moved.cpu())
    else:
        dist.all_reduce(tensor)
    return tensor
