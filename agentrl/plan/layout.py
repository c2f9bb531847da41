"""The cluster, the parallel layout and the workload a plan is made for, and which layouts can work."""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.plan.calibration import (ATTN_RES_MIXES, DEFAULT_ATTN_RES_MIX, H200_BF16_TFLOPS, H200_HBM_TBPS,
                                        KDA_CHUNK, USABLE_MEMORY_FRACTION, GiB)
from agentrl.plan.counts import ModelShape


@dataclass(kw_only=True, slots=True)
class Cluster:
    num_gpus: int
    gpu_memory_gib: float = 139.0  # what torch reports on an H200
    gpus_per_node: int = 8
    intra_node_gbytes_s: float = 900.0  # NVLink per GPU
    inter_node_gbits_s: float = 400.0  # per NIC
    nics_per_node: int = 8
    peak_tflops: float = H200_BF16_TFLOPS
    hbm_tbytes_s: float = H200_HBM_TBPS

    def __post_init__(self):
        for name in ("num_gpus", "gpus_per_node", "nics_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"Cluster.{name}={getattr(self, name)} must be >= 1")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"{self.num_gpus} GPUs is not a whole number of {self.gpus_per_node}-GPU nodes")

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gib * GiB * USABLE_MEMORY_FRACTION

    @property
    def inter_node_bytes_s_per_gpu(self) -> float:
        return self.inter_node_gbits_s / 8 * 1e9 * self.nics_per_node / self.gpus_per_node


@dataclass(kw_only=True, slots=True)
class Layout:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 1

    @property
    def num_gpus(self) -> int:
        return self.pp * self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        return self.dp * self.cp // self.ep

    def describe(self) -> str:
        return (f"PP {self.pp} × DP {self.dp} × CP {self.cp} = {self.num_gpus} GPUs; EP {self.ep} "
                f"(expert DP {self.expert_dp}); ZeRO-{self.zero}")


@dataclass(kw_only=True, slots=True)
class Workload:
    context: int = 32768  # tokens per sequence
    micro_batch_tokens: int | None = None  # tokens per micro-batch before CP splits it (default: one sequence)
    tokens_per_step: int = 16 * 2**20  # global batch of one optimizer step
    gradient_checkpointing: bool = True
    attn_res_mix: str = DEFAULT_ATTN_RES_MIX  # what an AttnRes mix keeps for backward: see ATTN_RES_MIXES

    def __post_init__(self):
        if self.micro_batch_tokens is None:
            self.micro_batch_tokens = self.context
        for name in ("context", "micro_batch_tokens", "tokens_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name}={getattr(self, name)} must be >= 1")
        if self.attn_res_mix not in ATTN_RES_MIXES:
            raise ValueError(f"Workload.attn_res_mix={self.attn_res_mix!r} must be one of {sorted(ATTN_RES_MIXES)}")


def check_layout(cfg, layout: Layout, cluster: Cluster, workload: Workload) -> None:
    """Raises ValueError naming the degree that cannot work for this model and cluster."""
    cfg = ModelShape.of(cfg)
    if layout.num_gpus != cluster.num_gpus:
        raise ValueError(f"layout {layout.describe()} does not use the cluster's {cluster.num_gpus} GPUs")
    if not 1 <= layout.pp <= cfg.num_hidden_layers:
        raise ValueError(f"pp={layout.pp}: needs 1 <= pp <= {cfg.num_hidden_layers} layers")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={layout.zero}: ZeRO stage must be 0, 1, 2 or 3")
    if (layout.dp * layout.cp) % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide dp·cp={layout.dp * layout.cp} (experts split over a stage's "
                         f"data-parallel ranks)")
    num_experts = cfg.num_experts or 1
    if num_experts % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide the {num_experts} routed experts")
    if workload.micro_batch_tokens % layout.cp or workload.micro_batch_tokens // layout.cp < KDA_CHUNK:
        raise ValueError(f"cp={layout.cp} must divide the {workload.micro_batch_tokens}-token micro-batch into "
                         f"pieces of at least {KDA_CHUNK} tokens")


def stages(cfg, pp: int) -> list[range]:
    """Contiguous layer ranges, the first stages one layer longer when pp does not divide the layers."""
    base, extra = divmod(cfg.num_hidden_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out
