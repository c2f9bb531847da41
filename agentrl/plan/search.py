"""The plan: the fastest layout that fits a cluster, or the smallest cluster that fits."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.plan.calibration import ATTN_RES_MIXES, GiB
from agentrl.plan.counts import ModelShape, ParamCounts, count_parameters
from agentrl.plan.decode import Decode, decode_throughput
from agentrl.plan.layout import Cluster, Layout, Workload, check_layout
from agentrl.plan.memory import Memory, activation_scale, memory_per_gpu
from agentrl.plan.timing import StepTime, step_time, weight_gather_s, weight_sync_s


@dataclass(kw_only=True, slots=True)
class Plan:
    params: ParamCounts
    cluster: Cluster
    workload: Workload
    layout: Layout
    memory: Memory
    time: StepTime
    weight_gather_s: float  # publishing: the full weights gathered onto one rank (weight_gather_s)
    weight_sync_s: float | None  # the in-memory sync into engines on the trainer's GPUs; None: no decode plan
    decode: Decode | None
    activation_scale: float  # measured / modelled activation memory on the calibration preset
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {name: asdict(getattr(self, name)) for name in ("params", "cluster", "workload", "layout", "memory",
                                                              "time")}
        out["params"].update(num_total=self.params.num_total, num_active=self.params.num_active)
        out["memory"]["total"] = self.memory.total
        out["time"]["total_s"] = self.time.total_s
        out["weight_gather_s"] = self.weight_gather_s
        out["weight_sync_s"] = self.weight_sync_s
        out["decode"] = None if self.decode is None else dict(asdict(self.decode),
                                                              tokens_per_s=self.decode.tokens_per_s)
        out["activation_scale"] = self.activation_scale
        out["notes"] = self.notes
        return out


def trainer_supports(layout: Layout) -> bool:
    """Whether agentrl's trainer runs this layout today (trainer/config.py): data parallelism under ZeRO-2 or -3,
    expert parallelism under ZeRO-2 only, context parallelism without expert parallelism; no pipeline yet."""
    return (layout.pp == 1 and layout.zero in (2, 3) and (layout.ep == 1 or layout.zero == 2)
            and (layout.cp == 1 or layout.ep == 1))


def candidate_layouts(cfg, cluster: Cluster, workload: Workload, fixed: dict[str, int] | None = None,
                      supported_only: bool = False) -> list[Layout]:
    """Every valid layout of the cluster's GPUs that agrees with the fixed degrees (searched: any pp dividing the
    GPUs, cp a power of two, ep any divisor, ZeRO 1-3), only those the trainer runs today if `supported_only`."""
    cfg = ModelShape.of(cfg)
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    world = cluster.num_gpus
    out = []
    pps = [fixed["pp"]] if "pp" in fixed else [p for p in range(1, min(cfg.num_hidden_layers, world) + 1)
                                                if world % p == 0]
    for pp in pps:
        rest = world // pp
        cps = [fixed["cp"]] if "cp" in fixed else [2**j for j in range(rest.bit_length()) if rest % 2**j == 0]
        for cp in cps:
            dp = rest // cp
            if "dp" in fixed and fixed["dp"] != dp:
                continue
            eps = [fixed["ep"]] if "ep" in fixed else range(1, dp * cp + 1)
            for ep in eps:
                for zero in ([fixed["zero"]] if "zero" in fixed else (1, 2, 3)):
                    layout = Layout(pp=pp, dp=dp, cp=cp, ep=ep, zero=zero)
                    try:
                        check_layout(cfg, layout, cluster, workload)
                    except ValueError:
                        continue
                    if supported_only and not trainer_supports(layout):
                        continue
                    out.append(layout)
    return out


def make_plan(cfg, cluster: Cluster, workload: Workload, fixed: dict[str, int] | None = None,
              mfu: float | None = None, with_decode: bool = True, supported_only: bool = False) -> Plan:
    """The fastest layout that fits (or the fixed one). Raises ValueError when nothing fits, with the closest miss."""
    cfg = ModelShape.of(cfg)
    act_scale = activation_scale()
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must lie in (0, 1]")
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    if fixed.keys() >= {"pp", "dp", "cp", "ep"}:
        check_layout(cfg, Layout(**{"zero": 1, **fixed}), cluster, workload)  # names the bad degree
    layouts = candidate_layouts(cfg, cluster, workload, fixed, supported_only)
    if not layouts:
        raise ValueError(f"no valid layout of {cluster.num_gpus} GPUs with {fixed or 'no fixed degrees'} "
                         f"(ep must divide dp·cp and the {cfg.num_experts} experts, pp ≤ "
                         f"{cfg.num_hidden_layers} layers, cp must split the micro-batch"
                         + ("; the trainer runs today only pp = 1, ZeRO-2 or -3, ep > 1 under ZeRO-2 only, cp > 1 "
                            "with ep = 1)"
                            if supported_only else ")"))
    best = closest = None
    for layout in layouts:
        mem = memory_per_gpu(cfg, layout, workload, act_scale)
        if mem.total > cluster.usable_bytes:
            if closest is None or mem.total < closest[1].total:
                closest = (layout, mem)
            continue
        t = step_time(cfg, layout, cluster, workload, mfu)
        if best is None or t.total_s < best[2].total_s:
            best = (layout, mem, t)
    if best is None:
        layout, mem = closest
        parts = dict(weights=mem.weights, gradients=mem.gradients, optimizer=mem.optimizer,
                     gathered_layers=mem.zero3_gather, activations=mem.activations_stored + mem.activations_transient,
                     logits=mem.logits)
        breakdown = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f}" for k, v in parts.items() if v)
        raise ValueError(
            f"nothing fits in {cluster.num_gpus} × {cluster.gpu_memory_gib} GiB GPUs "
            f"({cluster.usable_bytes / GiB:.1f} GiB usable each): the closest, {layout.describe()}, needs "
            f"{mem.total / GiB:.1f} GiB per GPU ({breakdown}). Add GPUs, shorten the context or the micro-batch, "
            f"or raise ZeRO / CP / EP / PP.")
    layout, mem, t = best
    notes = []
    if not trainer_supports(layout):
        notes.append("agentrl's trainer does not run this layout yet (today: pp = 1, ZeRO-2 or -3, ep > 1 under "
                     "ZeRO-2, cp > 1 with ep = 1; --supported-only restricts the search to that)")
    if cfg.attn_res_block_size is not None:
        notes.append(f"AttnRes mixes: {ATTN_RES_MIXES[workload.attn_res_mix]} (--attn-res-mix)")
    decode = None
    if with_decode:
        try:
            decode = decode_throughput(cfg, cluster, workload.context)
        except ValueError as exc:
            notes.append(f"rollout: {exc}")
    return Plan(params=count_parameters(cfg), cluster=cluster, workload=workload, layout=layout, memory=mem, time=t,
                weight_gather_s=weight_gather_s(cfg, layout, cluster), decode=decode, activation_scale=act_scale,
                weight_sync_s=None if decode is None else weight_sync_s(decode.weights_per_gpu, decode.replica_gpus,
                                                                        cluster),
                notes=notes)


def smallest_cluster(cfg, workload: Workload, fixed: dict[str, int] | None = None, mfu: float | None = None,
                     max_gpus: int = 2**16, supported_only: bool = False, **cluster_kwargs) -> Plan:
    """The plan on the fewest GPUs (1, 2, 4, ... up to a node, then whole nodes in powers of two) that fit."""
    cfg = ModelShape.of(cfg)
    gpn = cluster_kwargs.get("gpus_per_node", 8)
    sizes = [2**j for j in range(20) if 2**j < gpn] + [gpn * 2**j for j in range(20)]
    last_error = None
    for n in sizes:
        if n > max_gpus:
            break
        try:
            return make_plan(cfg, Cluster(num_gpus=n, **cluster_kwargs), workload, fixed, mfu,
                             supported_only=supported_only)
        except ValueError as exc:
            last_error = exc
    raise ValueError(f"no cluster of up to {max_gpus} GPUs fits: {last_error}")


def resolve_config(preset: str | None = None, path: str | None = None, overrides: dict[str, Any] | None = None):
    """A preset by name, or the config.json of a checkpoint directory (or the file itself)."""
    from agentrl.model.config import HybridMoEConfig, preset_config

    if (preset is None) == (path is None):
        raise ValueError("give exactly one of a preset name or a config path")
    if preset is not None:
        return preset_config(preset, **(overrides or {}))
    return HybridMoEConfig.from_pretrained(path, **(overrides or {}))
