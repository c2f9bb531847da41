"""The training forward and backward of a short micro-batch as two CUDA graph replays.

Why: a micro-batch of a few thousand tokens leaves the GPU idle most of its step. The host launches ~1,900 kernels
for the `small` preset's 4K forward and backward, ~75 µs each through fla's Python wrappers and autograd, for ~24 ms
of GPU work (docs/benchmarks.md, "The short step by part"). Recorded once per size, the forward and the backward
each become one graph launch (one pair per size and temperature).

How: `GraphedForward` serves a PackedPolicy's training calls. A micro-batch of T tokens and N sequences goes to the
smallest bucket of B ≥ T tokens; `pad_micro_batch` pads its tokens to B with one padding sequence and its offsets
to a fixed count with empty sequences (the shapes every launch depends on; agentrl/model/static_shapes.py). The
first micro-batch of a bucket records it (`RecordedPass`: eager warm-up passes, which also run Triton's
autotuning, then the capture); later ones copy their tokens into the graph's inputs and replay. The
log-probs and entropies of the padding are cut off, so the loss sees the eager forward's tokens, and the MoE
balancers leave the padding out (`counted_T`). What the warm-up passes counted is taken back out. A replay gives
the eager pass's gradient on the padded micro-batch; against the unpadded eager pass it differs by bf16 rounding
only (padding changes the GEMM shapes), which a GRPO gradient's cancellation can magnify to tens of percent of its
norm: compare with the same padding, or in fp64 (docs/benchmarks.md, "The 4K trainer step from CUDA graphs").

What it needs (TrainerConfig checks it): the parameters stay where the capture found them (ZeRO-1/2 update them
in place; ZeRO-3 frees and re-gathers them, through module hooks a graph would skip), no collectives inside the
model (context and expert parallelism), CUDA. Gradient checkpointing is off inside the graph: a bucket's graph keeps
its activations in its own memory pool, as much as an eager step of B tokens without checkpointing, for the life of
the trainer; the buckets are for short micro-batches, where that memory is small and the host is the bound.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.model.static_shapes import static_shapes
from agentrl.trainer.config import CUDA_GRAPH_SPARE_SEQUENCES as SPARE_SEQUENCES
from agentrl.trainer.forward import PackedPolicy

if TYPE_CHECKING:
    from agentrl.trainer.batching import MicroBatch


@dataclass(frozen=True, slots=True)
class PaddedMicroBatch:
    """A micro-batch at a bucket's shapes: what a graph's inputs are copied from."""

    input_ids_T: torch.Tensor  # [B] tokens; the padding sequence's are 0
    cu_seqlens: torch.Tensor  # [S + 1] int64: the N sequences, the padding sequence [T, B), then empty ones
    target_ids_T: torch.Tensor  # [B]
    forced_experts_TLK: torch.Tensor  # [B, L, K] int64; −1 rows leave a token's routing to the router
    counted_T: torch.Tensor  # [B] bool: the micro-batch's own tokens (the balancers count only these)
    num_tokens: int  # T


def pad_micro_batch(input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor, target_ids_T: torch.Tensor,
                    forced_experts_TLK: torch.Tensor | None, *, tokens: int, sequences: int,
                    moe_layers: int, top_k: int, counted: bool = True) -> PaddedMicroBatch:
    """Pads a packed micro-batch to `tokens` tokens and `sequences` sequences (`sequences` + 1 offsets).

    The tokens past T form one padding sequence, so every token belongs to a sequence (fla's graph-mode kernels leave
    rows outside all sequences undefined), and at least one empty sequence closes the offsets (static_shapes.py).
    `counted`: whether the balancers count the micro-batch's tokens (False for a rank's padding micro-batch)."""
    num_tokens, num_seqs = input_ids_T.numel(), cu_seqlens.numel() - 1
    if num_tokens > tokens or num_seqs + SPARE_SEQUENCES > sequences:
        raise ValueError(f"a micro-batch of {num_tokens} tokens in {num_seqs} sequences does not fit a graph of "
                         f"{tokens} tokens and {sequences} sequences ({SPARE_SEQUENCES} are kept for padding)")
    device = input_ids_T.device
    pad = tokens - num_tokens
    offsets = torch.cat([cu_seqlens.to(device=device, dtype=torch.long),
                         torch.full((sequences - num_seqs,), tokens, dtype=torch.long, device=device)])
    if forced_experts_TLK is None:
        forced = torch.full((tokens, moe_layers, top_k), -1, dtype=torch.long, device=device)
    else:
        forced = torch.cat([forced_experts_TLK.to(device=device, dtype=torch.long),
                            torch.full((pad, moe_layers, top_k), -1, dtype=torch.long, device=device)])
    counted_T = torch.arange(tokens, device=device) < (num_tokens if counted else 0)
    targets = target_ids_T.to(device)
    return PaddedMicroBatch(input_ids_T=torch.cat([input_ids_T, input_ids_T.new_zeros(pad)]), cu_seqlens=offsets,
                            target_ids_T=torch.cat([targets, targets.new_zeros(pad)]), forced_experts_TLK=forced,
                            counted_T=counted_T, num_tokens=num_tokens)


class RecordedPass:
    """The training forward (PackedPolicy's: the decoder and the log-prob head, at one temperature) and its
    backward at one bucket's shapes, recorded as two CUDA graphs. The graph's inputs are the tensors of a
    PaddedMicroBatch, in its field order.

    They are recorded over aliases of the parameters (the same storage, new leaf tensors), not the parameters
    themselves: DeepSpeed keeps each parameter's gradient-accumulation node alive to hook it, and that node belongs
    to the stream it was made on, so a backward recorded into it on the capture stream would make the default stream
    wait inside the capture, which CUDA refuses. Replayed through `_Replay`, whose inputs are the real parameters,
    the gradients reach those nodes, and DeepSpeed's hooks, on the stream the trainer runs on.
    """

    def __init__(self, policy: HybridMoEForCausalLM, temperature: float, args: tuple[torch.Tensor, ...],
                 warmups: int = 2):
        named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        aliases = {f"policy.{n}": p.detach().requires_grad_() for n, p in named}
        module = PackedPolicy(policy, temperature)
        self.inputs = [a.clone() for a in args]

        def run():
            input_ids, cu_seqlens, targets, forced, counted = self.inputs
            return torch.func.functional_call(module, aliases, (input_ids, cu_seqlens, targets, forced),
                                              {"counted_T": counted}, strict=False)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eagerly first: Triton's autotuning and lazy allocations stay out of the graph
            for _ in range(warmups):
                outputs = run()
                torch.autograd.grad(outputs, list(aliases.values()), [torch.ones_like(o) for o in outputs],
                                    allow_unused=True)
            del outputs
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool):
            self.outputs = run()
        self.output_grads = [torch.empty_like(o) for o in self.outputs]
        with torch.cuda.graph(self.backward_graph, pool=pool):
            self.grads = torch.autograd.grad(self.outputs, list(aliases.values()), self.output_grads,
                                             allow_unused=True)
        self.outputs = [o.detach() for o in self.outputs]  # the recorded autograd graph is not needed again

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for static, new in zip(self.inputs, args):
            static.copy_(new)
        return _Replay.apply(self, *self.params)


class _Replay(torch.autograd.Function):
    """Replays a RecordedPass: its forward graph now, its backward graph when autograd reaches it, with the real
    parameters as inputs so that their gradients flow to them."""

    @staticmethod
    def forward(ctx, recorded: RecordedPass, *params: torch.Tensor):
        ctx.recorded = recorded
        recorded.forward_graph.replay()
        return tuple(o.detach() for o in recorded.outputs)

    @staticmethod
    def backward(ctx, *output_grads: torch.Tensor):
        recorded = ctx.recorded
        for static, grad in zip(recorded.output_grads, output_grads):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        recorded.backward_graph.replay()
        return (None, *(None if g is None else g.detach() for g in recorded.grads))


class GraphedForward:
    """The training forward of a policy, replayed from a CUDA graph per (bucket, temperature) when a micro-batch
    fits a bucket; None from `__call__` when it does not (the caller runs it eagerly).

    Args:
        policy: the model the trainer optimises, on its CUDA device, with its final parameters (after DeepSpeed has
            placed them).
        buckets: increasing token counts; a micro-batch goes to the smallest that holds it.
        max_sequences: the sequences of a bucket's offsets (a micro-batch may hold SPARE_SEQUENCES fewer).

    Under data parallelism the ranks of one gradient reduction must take the same path for a micro-batch: DeepSpeed's
    ZeRO-2 buckets fill in the order the gradients arrive, and a replay hands autograd every gradient at once, which
    reach the hooks in another order than an eager backward's. `replayable` says where every rank's micro-batch fits,
    and calls inside `allowing(False)` run eagerly.

    The parameters' gradients arrive from the graph's own buffers: autograd may make a buffer a parameter's `.grad`,
    which the next replay rewrites. DeepSpeed's ZeRO-1/2 hooks copy each gradient into their buckets as it arrives,
    which is what the trainer relies on; a plain optimizer accumulating `.grad` over micro-batches would not.
    """

    def __init__(self, policy: HybridMoEForCausalLM, buckets: Sequence[int], max_sequences: int):
        self.policy = policy
        self.buckets = list(buckets)
        self.max_sequences = max_sequences
        self.graphs: dict[tuple[int, float], RecordedPass] = {}
        self.replays = 0  # micro-batches served from a graph (captures included)
        self.recordings = 0  # graphs recorded (a moved parameter or buffer records its bucket again)
        self.captured_at: tuple[int, ...] = ()  # where the parameters and buffers were when the graphs were recorded
        self.allowed = True  # False inside allowing(False): every call runs eagerly
        moe = policy.moe_layers
        self.top_k = moe[0].gate.top_k if moe else 1

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_tokens)
        if i == len(self.buckets) or num_seqs + SPARE_SEQUENCES > self.max_sequences:
            return None
        return self.buckets[i]

    def replayable(self, per_rank: Sequence[Sequence[MicroBatch]]) -> list[bool]:
        """Per position in a step's micro-batch lists (one list per data-parallel rank, all of one length), whether
        every rank's micro-batch there fits a bucket."""
        return [all(self.bucket_for(m.num_tokens, m.num_sequences) is not None for m in position)
                for position in zip(*per_rank, strict=True)]

    @contextlib.contextmanager
    def allowing(self, allowed: bool) -> Iterator[None]:
        """Within the block, calls replay only if `allowed` (and the micro-batch fits); eagerly otherwise."""
        was, self.allowed = self.allowed, allowed
        try:
            yield
        finally:
            self.allowed = was

    def __call__(self, input_ids_T: torch.Tensor, cu_seqlens: torch.Tensor, target_ids_T: torch.Tensor,
                 forced_experts_TLK: torch.Tensor | None, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        tokens = self.bucket_for(input_ids_T.numel(), cu_seqlens.numel() - 1) if self.allowed else None
        if tokens is None:
            return None
        moe = self.policy.moe_layers
        padded = pad_micro_batch(input_ids_T, cu_seqlens, target_ids_T, forced_experts_TLK, tokens=tokens,
                                 sequences=self.max_sequences, moe_layers=len(moe), top_k=self.top_k,
                                 counted=all(m.gate.training for m in moe))  # balancers_observing(False): none
        args = (padded.input_ids_T, padded.cu_seqlens, padded.target_ids_T, padded.forced_experts_TLK,
                padded.counted_T)
        addresses = self._addresses()
        if addresses != self.captured_at:  # a graph reads the tensors it recorded: if any moved, record anew
            self.graphs.clear()
            self.captured_at = addresses
        key = (tokens, float(temperature))
        graphed = self.graphs.get(key)
        if graphed is None:
            graphed = self.graphs[key] = self._capture(args, float(temperature))
            self.recordings += 1
        self.replays += 1
        logprobs_T, entropy_T = graphed(*args)
        # the graph's outputs are its own buffers, rewritten by the next replay: the loss gets copies
        return logprobs_T[:padded.num_tokens].clone(), entropy_T[:padded.num_tokens].clone()

    def _addresses(self) -> tuple[int, ...]:
        """Where every parameter and buffer lives. ZeRO-1/2 write the new weights into the same storage and the
        balancers write the new bias in place, but a checkpoint load or a dtype cast may move a tensor."""
        return tuple(t.data_ptr() for t in (*self.policy.parameters(), *self.policy.buffers()))

    def _capture(self, args: tuple[torch.Tensor, ...], temperature: float) -> RecordedPass:
        model = self.policy.model
        gates = [m.gate for m in self.policy.moe_layers]
        counters = [(g.balancer.load_E, g.balancer.hist_EB) for g in gates]
        before = [tuple(None if c is None else c.clone() for c in pair) for pair in counters]
        checkpointing, observing = model.gradient_checkpointing, [g.training for g in gates]
        model.gradient_checkpointing = False  # the graph keeps the activations (see the module docstring)
        for g in gates:
            g.training = True  # recorded observing; a replay for a padding micro-batch counts no token instead
        try:
            with static_shapes():
                graphed = RecordedPass(self.policy, temperature, args)
        finally:
            model.gradient_checkpointing = checkpointing
            for g, was in zip(gates, observing):
                g.training = was
            # the warm-up passes observed the micro-batch eagerly; its replay counts it once
            for g, (load, hist) in zip(gates, before):
                for now, then in ((g.balancer.load_E, load), (g.balancer.hist_EB, hist)):
                    if now is not None and then is None:
                        now.zero_()
                    elif now is not None:
                        now.copy_(then)
        return graphed
