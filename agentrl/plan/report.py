"""The text `agentrl plan` prints."""

from __future__ import annotations

from agentrl.plan.calibration import BYTES_WEIGHT, CALIBRATION_PRESET, CHECKPOINTING_SPEED, GiB
from agentrl.plan.counts import COMPONENTS
from agentrl.plan.search import Plan
from agentrl.plan.timing import calibrated_efficiency


def _b(n: float) -> str:
    return f"{n / 1e9:,.3f}B" if n >= 1e8 else f"{n / 1e6:,.3f}M"


def format_plan(plan: Plan, name: str) -> str:
    """The text `agentrl plan` prints."""
    p, c, w, lay, m, t = plan.params, plan.cluster, plan.workload, plan.layout, plan.memory, plan.time
    lines = [f"model {name}", "parameters                      total          active"]
    for comp in COMPONENTS:
        if p.total[comp]:
            lines.append(f"  {comp:20s} {_b(p.total[comp]):>14s} {_b(p.active[comp]):>14s}")
    lines.append(f"  {'total':20s} {_b(p.num_total):>14s} {_b(p.num_active):>14s}")
    lines += [
        "",
        f"cluster  {c.num_gpus} GPUs of {c.gpu_memory_gib:g} GiB ({c.usable_bytes / GiB:.1f} GiB usable), "
        f"{c.gpus_per_node} per node; NVLink {c.intra_node_gbytes_s:g} GB/s, "
        f"{c.nics_per_node} × {c.inter_node_gbits_s:g} Gb/s per node; {c.peak_tflops:g} TFLOP/s bf16",
        f"workload {w.context:,} tokens per sequence, micro-batch {w.micro_batch_tokens:,} tokens, "
        f"{w.tokens_per_step:,} tokens per step, gradient checkpointing "
        f"{'on' if w.gradient_checkpointing else 'off'}",
        f"layout   {lay.describe()}",
        "",
        f"memory per GPU (GiB), stage {m.stage} of {lay.pp} (layers {m.layers[0]}–{m.layers[1]}), the heaviest",
    ]
    lines[-1] += f"; activations × {plan.activation_scale:.2f} (calibrated)"
    for label, value in (("weights (bf16)", m.weights), ("gradients (bf16)", m.gradients),
                         ("optimizer (fp32 master, m, v)", m.optimizer), ("ZeRO-3 gathered layers", m.zero3_gather),
                         ("activations kept (× in-flight)", m.activations_stored),
                         ("one layer recomputed + backward", m.activations_transient),
                         ("  (KDA chunk states, one layer)", m.kda_states),
                         ("  (MLA keys + values, one layer)", m.mla_kv),
                         ("logits chunk", m.logits)):
        lines.append(f"  {label:32s} {value / GiB:9.2f}")
    lines.append(f"  {'total':32s} {m.total / GiB:9.2f}  of {c.usable_bytes / GiB:.1f} usable")
    tokens_s = t.tokens_per_step / t.total_s
    if t.mfu_calibrated:
        e_dense, e_attention = calibrated_efficiency()
        source = (f"matmul work at {e_dense:.1%} and attention at {e_attention:.1%} of peak, calibrated on the "
                  f"`{CALIBRATION_PRESET}` preset")
        if w.gradient_checkpointing:
            source += f", × {CHECKPOINTING_SPEED} for recomputation"
    else:
        source = "given"
    lines += ["", f"training step (slowest stage; MFU {t.mfu:.1%}: {source})"]
    for label, value in (("compute", t.compute_s), ("expert all-to-all", t.expert_all_to_all_s),
                         ("ZeRO collectives", t.zero_collectives_s), ("context-parallel gathers", t.context_parallel_s),
                         ("pipeline sends", t.pipeline_send_s), ("pipeline bubble", t.bubble_s)):
        lines.append(f"  {label:32s} {value:9.3f} s")
    lines.append(f"  {'step':32s} {t.total_s:9.3f} s  = {tokens_s:,.0f} tokens/s "
                 f"({tokens_s / c.num_gpus:,.0f} per GPU)")
    fits_one = p.num_total * BYTES_WEIGHT <= c.usable_bytes
    if plan.weight_sync_s is not None:
        lines.append(f"  {'weight sync in memory':32s} {plan.weight_sync_s:9.3f} s  (each GPU's engine shard, "
                     f"{plan.decode.weights_per_gpu / GiB:.1f} GiB: its links, then CUDA IPC at the measured rate)")
    lines.append(f"  {'publish: gather weights to one':32s} {plan.weight_gather_s:9.3f} s  (link-bound; the disk path"
                 + (")" if fits_one else f"; {p.num_total * BYTES_WEIGHT / GiB:,.0f} GiB of bf16 weights do not "
                    f"fit one GPU: only the in-memory stream works at this size)"))
    d = plan.decode
    if d is not None:
        lines += ["", f"rollout (decode at {w.context:,} tokens of context; assumed efficiencies, not calibrated)",
                  f"  replica {d.replica_gpus} GPUs (experts over all, the rest tensor-parallel in a node) × "
                  f"{d.num_replicas}; weights {d.weights_per_gpu / GiB:.1f} GiB per GPU",
                  f"  state per sequence {d.state_bytes_per_seq / GiB:.3f} GiB; {d.seqs_per_replica:,} sequences "
                  f"per replica; step {d.step_s * 1e3:.1f} ms ({d.bound}-bound)",
                  f"  {d.tokens_per_s_replica:,.0f} tokens/s per replica, {d.tokens_per_s:,.0f} on the cluster "
                  f"({d.tokens_per_s / c.num_gpus:,.0f} per GPU)"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
