"""The host's share of a training step, counted on CPU: the aten operations each kind of layer dispatches in its
forward and its backward, in the form the model takes on CUDA.

On a GPU the `small` preset's 4K step is host-bound (docs/benchmarks.md, issue 26: 1,944 kernel launches for 24 ms
of kernels, 145 ms of wall time), so what it costs is roughly the number of operations the host dispatches. Every
aten operation that is not a view is one (or a few) kernel launches on CUDA; this counts them without a GPU. The
model branches on the device in a few places (fla's Triton kernels for KDA, its gate, norms and short convolution,
and for Block AttnRes's mix; torch's fused RMSNorm; the grouped GEMM; MLA's attention kernels): here those calls run
through stand-ins that take the CUDA branch's place, compute with the PyTorch reference, and count as one fused call
each instead of their reference's operations. What runs inside such a call on CUDA (fla's wrappers launch several
kernels, and copy a strided input to a contiguous one) is not seen. The counts are exact and repeatable: no timing
is involved, so one run per tree is the whole measurement.

    .venv/bin/python scripts/bench_host_ops.py                  # the `small` preset, 512 tokens
    .venv/bin/python scripts/bench_host_ops.py --checkpointing  # with activation checkpointing (forward runs twice)
    .venv/bin/python scripts/bench_host_ops.py --trainer        # DeepSpeed's step (one rank) against the bare one
    .venv/bin/python scripts/bench_host_ops.py --host-time zero2 zero3 [--phases] [--profile 40]   # timed

`--trainer` counts a `PolicyTrainer.step` (ZeRO-2 and ZeRO-3, one rank on gloo, gradient checkpointing on, as the
trainer defaults) against the bare forward + backward of the same packed micro-batch (issue 26, item 3: DeepSpeed's
cost around the step), and lists the call sites in DeepSpeed and in agentrl's trainer that dispatch the most.
DeepSpeed's CPU accelerator runs without `overlap_comm` (no side stream), and the bare step's AdamW runs the
foreach form (fused AdamW is CUDA's), so the optimizer rows are CPU's, not CUDA's.

`--host-time` times what the counts cannot see, the host's Python around each dispatch (DeepSpeed's hooks, bucket
bookkeeping and ZeRO-3's per-module fetches): the preset's structure at widths where compute is negligible
(`narrow_config`), one thread, DeepSpeed's step (bench_gpu.py's TRAINER_VARIANTS, by name) alternating with the bare
forward + backward. The stand-ins' reference compute (a GPU kernel's work) is timed apart and taken out: "host" is
what is left, the Python and dispatches a GPU's host would run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)  # the checkout's agentrl

from agentrl.model import attn_res, kda_ops, layers, mla, moe  # noqa: E402
from agentrl.model.config import preset_config  # noqa: E402
from agentrl.model.modeling import HybridMoEForCausalLM  # noqa: E402
from agentrl.report import markdown_table  # noqa: E402

# operations that make no kernel: views and metadata
_NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "permute", "select", "slice", "narrow", "detach", "alias",
              "unsqueeze", "squeeze", "expand", "split", "split_with_sizes", "unbind", "chunk", "as_strided",
              "reshape", "promote_types", "lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations that would launch kernels, and the stand-in fused calls, while active; with
    `sites`, also the innermost frame of each under a path containing one of them."""

    def __init__(self, sites: tuple[str, ...] = ()):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.fused = 0
        self.paused = 0
        self.sites = sites
        self.by_site: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in _NO_KERNEL:
            self.ops[name] += 1
            if self.sites:
                stack = traceback.extract_stack()[:-1]
                frames = [f for f in stack if any(s in f.filename for s in self.sites)]
                if frames and not _the_models(frames[-1], stack):
                    where = frames[-1]
                    path = where.filename.split("site-packages/")[-1].replace(_ROOT + "/", "").replace(
                        os.path.dirname(_ROOT) + "/", "")
                    self.by_site[(name, f"{path}:{where.lineno} {where.name}")] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + self.fused


def _the_models(innermost, stack) -> bool:
    """Whether an operation is the model's own (the bare step has it too): issued by the model's code, or by
    autograd, inside the trainer's forward of a micro-batch or DeepSpeed's backward of its loss. DeepSpeed's
    gradient hooks run inside that backward too, and stay counted."""
    def model_pass(frame) -> bool:
        return ((frame.filename.endswith("trainer/forward.py") and frame.name == "forward")
                or (frame.filename.endswith("deepspeed/runtime/engine.py") and frame.name == "backward"))

    return model_pass(innermost) or ("agentrl/model/" in innermost.filename and any(model_pass(f) for f in stack))


_COUNTER: list[OpCounter] = []
# the stand-ins' insides: how deep the current call is in them, and the seconds spent there (outermost calls only):
# their reference compute is a GPU kernel's work, not the host's, and --host-time takes it out of its timings
_STAND_INS = {"depth": 0, "seconds": 0.0}


@contextlib.contextmanager
def _uncounted(as_fused_call: bool = True):
    for counter in _COUNTER:
        counter.paused += 1
    _STAND_INS["depth"] += 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _STAND_INS["depth"] -= 1
        if not _STAND_INS["depth"]:
            _STAND_INS["seconds"] += time.perf_counter() - start
        for counter in _COUNTER:
            counter.paused -= 1
            counter.fused += as_fused_call


@contextlib.contextmanager
def host_clock():
    """Yields a record whose `wall` seconds, and of them the `host` seconds outside the stand-ins' insides, are set
    when the block ends."""
    clock = SimpleNamespace(wall=0.0, host=0.0)
    inside, start = _STAND_INS["seconds"], time.perf_counter()
    try:
        yield clock
    finally:
        clock.wall = time.perf_counter() - start
        clock.host = clock.wall - (_STAND_INS["seconds"] - inside)


def host_seconds(fn) -> tuple[float, float]:
    """(wall seconds of `fn()`, of them the seconds outside the stand-ins' insides)."""
    with host_clock() as clock:
        fn()
    return clock.wall, clock.host


@contextlib.contextmanager
def phase_clock(targets):
    """Wraps each (object, attribute, label) of `targets` so that its calls add their host seconds (`host_clock`'s)
    to the yielded dict's `label`; the attributes are restored after."""
    spent: collections.defaultdict = collections.defaultdict(float)
    saved = [(obj, name, name in vars(obj), getattr(obj, name)) for obj, name, _ in targets]
    for (obj, name, _, fn), (_, _, label) in zip(saved, targets):
        def timed(*args, _fn=fn, _label=label, **kwargs):
            with host_clock() as clock:
                out = _fn(*args, **kwargs)
            spent[_label] += clock.host
            return out
        setattr(obj, name, timed)
    try:
        yield spent
    finally:
        for obj, name, own, fn in saved:
            setattr(obj, name, fn) if own else delattr(obj, name)


class _Fused(torch.autograd.Function):
    """A CUDA kernel's stand-in: `fn`'s PyTorch reference, counted as one call forward and one backward."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with _uncounted(), torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with _uncounted(), torch.enable_grad():
            outputs = ctx.fn(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            wanted = [x for x in inputs if x.requires_grad]
            got = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
        return (None, *[next(got) if x.requires_grad else None for x in inputs])


def fused(fn, *inputs):
    return _Fused.apply(fn, *inputs)


def _reference(fn, *args, **kwargs):
    """`fn` with agentrl's own CUDA branches off (the stand-ins call the PyTorch forms)."""
    previous = layers.set_fused(False)
    try:
        return fn(*args, **kwargs)
    finally:
        layers.set_fused(previous)


def _conv(x_BTC, weight, activation, cu_seqlens):
    return fused(lambda x, w: _reference(layers.short_conv, x[0], w[:, None], cu_seqlens, None, activation)[0][None],
                 x_BTC, weight), None


_FLA = {
    "fla.modules.norm.fused_norm_gate": SimpleNamespace(
        rms_norm_gated=lambda x, gate, weight, bias, activation, eps: fused(
            lambda x, g, w: layers.gated_rms_norm_torch(x, w, g, eps), x, gate, weight)),
    "fla.modules.norm.l2norm": SimpleNamespace(l2norm=lambda x, eps: fused(
        lambda x: layers.l2norm_torch(x, eps), x)),
    "fla.modules.causal_conv1d.ops": SimpleNamespace(
        causal_conv1d=lambda x, weight, activation, cu_seqlens: _conv(x, weight, activation, cu_seqlens)),
    "fla.ops.attnres": SimpleNamespace(fused_attnres=lambda query, residuals, rms_weight, rms_eps: fused(
        lambda q, w, *sources: attn_res.attn_res_mix_torch(
            list(sources), SimpleNamespace(weight=w, variance_epsilon=rms_eps), SimpleNamespace(weight=q[None])),
        query, rms_weight, *residuals)),
}


def _fla_op(x, module):
    return _FLA.get(module) if layers.fused_enabled() else None


def _kda_kernel(q, k, v, g, beta, *, output_final_state, gate=None, **kwargs):
    """fla's KDA: one call, with the layer's prologue (norms, gate, sigmoid) inside it when handed `gate`."""
    params = () if gate is None else (gate.A_log, gate.dt_bias)

    def run(q, k, v, g, beta, *params, final_state=False):
        return _reference(_cpu_kda, q, k, v, g, beta, output_final_state=final_state,
                          gate=kda_ops.GateParams(*params) if params else None, **kwargs)

    o = fused(lambda *t: run(*t)[0], q, k, v, g, beta, *params)
    final = None
    if output_final_state:  # the final state has no gradient: computed outside the stand-in, uncounted
        with _uncounted(as_fused_call=False), torch.no_grad():
            final = run(q, k, v, g, beta, *params, final_state=True)[1]
    return o, final


_cpu_kda = kda_ops.kda


def _group_ends(x_SK, counts_E):
    if not (layers.fused_enabled() and x_SK.shape[0]):  # inside a stand-in's reference: the CPU branch
        return None
    return torch.cumsum(counts_E, 0).to(torch.int32)  # the CUDA branch's operations


def _grouped_matmul(x_SK, w_ENK, counts_E, ends_E=None):
    if ends_E is None:  # a caller that did not compute the ends (or a tree from before `group_ends`)
        _group_ends(x_SK, counts_E)
    return fused(lambda x, w: _reference(_cpu_grouped_matmul, x, w, counts_E), x_SK, w_ENK)


_cpu_grouped_matmul = moe.grouped_matmul


def _mla_attention(q, kv, k_pe, cu_seqlens, scale, **kwargs):
    return fused(lambda q, kv, k_pe: _reference(_cpu_mla_attention, q, kv, k_pe, cu_seqlens, scale, **kwargs),
                 q, kv, k_pe)


_cpu_mla_attention = mla.mla_attention


@contextlib.contextmanager
def cuda_form():
    """The model's CUDA branches, taken on CPU through the stand-ins."""
    saved = (layers.fla_op, attn_res.fla_op, kda_ops.kda, moe.grouped_matmul,
             getattr(moe, "group_ends", None), mla.mla_attention, layers.RMSNorm.forward)
    layers.fla_op = attn_res.fla_op = _fla_op
    kda_ops.kda = _kda_kernel
    moe.grouped_matmul = _grouped_matmul
    moe.group_ends = _group_ends
    mla.mla_attention = _mla_attention
    layers.RMSNorm.forward = lambda self, x: fused(
        lambda x, w: layers.rms_norm_torch(x, w, self.variance_epsilon), x, self.weight)
    try:
        yield
    finally:
        (layers.fla_op, attn_res.fla_op, kda_ops.kda, moe.grouped_matmul, moe.group_ends,
         mla.mla_attention, layers.RMSNorm.forward) = saved


def count(step, sites: tuple[str, ...] = (), backward_context=contextlib.nullcontext) -> tuple[OpCounter, OpCounter]:
    """The operations of `step()`'s forward (it returns a scalar loss) and of its backward (run under
    `backward_context()`)."""
    loss = []
    forward = count_call(lambda: loss.append(step()), sites)

    def backward():
        with backward_context():
            loss[0].backward()
    return forward, count_call(backward, sites)


def count_call(fn, sites: tuple[str, ...] = ()) -> OpCounter:
    counter = OpCounter(sites)
    _COUNTER.append(counter)
    try:
        with counter:
            fn()
    finally:
        _COUNTER.pop()
    return counter


def parts(model, tokens: int):
    """(name, layers of that kind, a fwd-loss function for one of them) for the layer kinds of the model."""
    config = model.config
    hidden = torch.randn(tokens, config.hidden_size, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    kinds = [("KDA attention (with its norm)", lambda layer: layer.is_kda,
              lambda layer, h: layer.attention(h, cu_seqlens, None, False)),
             ("MLA attention (with its norm)", lambda layer: not layer.is_kda,
              lambda layer, h: layer.attention(h, cu_seqlens, None, False)),
             ("MoE feed-forward (with its norm)", lambda layer: layer.is_moe,
              lambda layer, h: layer.feed_forward(h, None)[0]),
             ("dense MLP (with its norm)", lambda layer: not layer.is_moe,
              lambda layer, h: layer.feed_forward(h, None)[0])]
    for name, chosen, forward in kinds:
        matching = [layer for layer in model.model.layers if chosen(layer)]
        if matching:
            yield name, len(matching), (lambda f=forward, layer=matching[0]:
                                        f(layer, hidden.detach().requires_grad_()).float().sum())


def bench_layers(preset: str, tokens: int, checkpointing: bool) -> None:
    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config(preset)).to(torch.bfloat16).train()
    rows = []
    with cuda_form():
        for name, num_layers, step in parts(model, tokens):
            if checkpointing:
                plain = step
                step = lambda plain=plain: torch.utils.checkpoint.checkpoint(plain, use_reentrant=False)  # noqa: E731
            # as the trainer: a recomputation in the backward does not feed the balancers again
            without_balancers = lambda: model.balancers_observing(False)  # noqa: E731
            count(step, backward_context=without_balancers)  # a first call: lazily built state is not a step's cost
            model.zero_grad(set_to_none=True)
            fwd, bwd = count(step, backward_context=without_balancers)
            model.zero_grad(set_to_none=True)
            per_layer = fwd.total + bwd.total
            rows.append([name, num_layers, sum(fwd.ops.values()), sum(bwd.ops.values()), fwd.fused, bwd.fused,
                         per_layer, num_layers * per_layer])
            top = (fwd.ops + bwd.ops).most_common(8)
            print(f"  {name}: most frequent: " + ", ".join(f"{op} {n}" for op, n in top), flush=True)
    print(f"\n### Host dispatches per layer, `{preset}` preset, {tokens} tokens, bf16, CPU in the CUDA form"
          + (", activation checkpointing" if checkpointing else "") + "\n")
    print(markdown_table(["part", "layers", "aten ops fwd", "aten ops bwd", "fused calls fwd", "fused calls bwd",
                          "dispatches per layer", "× layers"],
                         rows + [["all layers", sum(r[1] for r in rows), "", "", "", "", "", sum(r[7] for r in rows)]]))


@contextlib.contextmanager
def zero3_module_fetches(counts: collections.Counter):
    """Counts ZeRO-3's parameter fetches per module call (`fetch_sub_module`: the hook's pass of Python over the
    module's parameters, forward, recomputation and backward) and the parameters they cover: host work that the
    dispatch counts miss, since at one rank nothing is gathered (DeepSpeed's `_no_gather_coalesced`)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator, iter_params
    from deepspeed.utils import z3_leaf_module

    fetch = PartitionedParameterCoordinator.fetch_sub_module

    def counted(self, module, *args, **kwargs):
        counts["modules"] += 1
        counts["parameters"] += sum(1 for _ in iter_params(module, recurse=z3_leaf_module(module)))
        return fetch(self, module, *args, **kwargs)

    PartitionedParameterCoordinator.fetch_sub_module = counted
    try:
        yield
    finally:
        PartitionedParameterCoordinator.fetch_sub_module = fetch


def _one_rank_rendezvous() -> None:
    """The variables DeepSpeed's process group reads, for one rank on this host (a free port)."""
    from agentrl.net import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")


def bare_model(config):
    """The plain bf16 model of `config` that DeepSpeed's step is measured against (bench_gpu.bare_step runs it)."""
    torch.manual_seed(0)
    return HybridMoEForCausalLM(config).to(torch.bfloat16)


def bench_trainer(preset: str, tokens: int, top: int) -> None:
    """DeepSpeed's step on one rank against the bare forward + backward (and + AdamW) of the same micro-batches."""
    from agentrl.trainer import PolicyTrainer, TrainerConfig

    _one_rank_rendezvous()
    from bench_gpu import _trainer_batch, bare_step  # bench_gpu's trainer table (its script directory is ours)

    config = preset_config(preset)
    batch = _trainer_batch(config.vocab_size, tokens)
    sites = ("deepspeed/", "/trainer/", "/agentrl/model/")
    rows, site_rows = [], []
    with cuda_form():
        model = bare_model(config)
        plan, bare = bare_step(model, batch, tokens, device="cpu")
        adam = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
        bare(adam)
        bare_ops = count_call(bare).total
        rows.append(["bare fwd+bwd", bare_ops, "", "", "", ""])
        rows.append(["bare + AdamW (foreach)", count_call(lambda: bare(adam)).total, "", "", "", ""])
        for stage in (2, 3):
            with tempfile.TemporaryDirectory() as run_dir:
                trainer = PolicyTrainer(TrainerConfig(run_dir=run_dir, zero_stage=stage, dtype="bf16", lr=1e-6,
                                                      micro_batch_tokens=tokens), config)
                for _ in range(2):  # ZeRO-3 records its parameter trace over the first steps
                    trainer.step(batch)
                fetches: collections.Counter = collections.Counter()
                with zero3_module_fetches(fetches):
                    counter = count_call(lambda: trainer.step(batch), sites)
                trainer.close()
            syncs = counter.ops["_local_scalar_dense"]
            rows.append([f"ZeRO-{stage} step", counter.total, counter.total - bare_ops, syncs,
                         sum(counter.by_site.values()),
                         f"{fetches['modules']} / {fetches['parameters']}" if stage == 3 else ""])
            site_rows += [[f"ZeRO-{stage}", op, f"`{site}`", n] for (op, site), n in counter.by_site.most_common(top)]
    print(f"\n### Host dispatches of one training step, `{preset}` preset, {tokens} tokens in "
          f"{len(plan.per_rank[0])} micro-batch(es), one rank, CPU in the CUDA form\n")
    print(markdown_table(["step", "dispatches", "over the bare step", "scalar reads (host syncs on CUDA)",
                          "outside the model's forward and backward", "ZeRO-3 module fetches / parameters fetched"],
                         rows))
    print(f"\n### Where the dispatches outside the model's forward and backward come from (DeepSpeed, the trainer, "
          f"Quantile Balancing's update), top {top} per stage\n")
    print(markdown_table(["step", "aten op", "innermost DeepSpeed / trainer frame", "calls"], site_rows))


# widths at which a step's compute is negligible next to the host's work; the structure (layers, experts, top-k,
# heads, every parameter's name) stays the preset's. Quantile Balancing's histograms too: 4,096 bins per expert are
# a few microseconds of a GPU's time but milliseconds of this CPU's (their fp64 copy and cumulative sum)
_NARROW = dict(vocab_size=512, hidden_size=32, intermediate_size=64, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=16, routed_expert_hidden_size=16,
               moe_balancing_bins=16)
_STRUCTURAL = ("routed_expert_hidden_size",)  # set only where the preset sets it: it adds the latent projections


def narrow_config(preset: str):
    """The preset's structure at the `_NARROW` widths (KDA's heads 8 wide): what its step costs the host."""
    from agentrl.model.config import PRESETS

    base = PRESETS[preset]
    narrow = {k: v for k, v in _NARROW.items() if k not in _STRUCTURAL or k in base}
    return preset_config(preset, **narrow, linear_attn_config=dict(base["linear_attn_config"], head_dim=8))


_PHASES = ("forward and loss", "autograd's backward (DeepSpeed's gradient hooks inside)",
           "DeepSpeed's backward around autograd's", "optimizer step (engine.step)",
           "the rest of PolicyTrainer.step")


def _phases_of(total: float, spent: dict) -> list[float]:
    """A step's host seconds by `_PHASES`, from its total and what `phase_clock` recorded (the bare step has no
    DeepSpeed phases: zero)."""
    forward = spent["forward"]
    around = spent.get("engine.backward", spent["autograd"]) - spent["autograd"]
    step = spent.get("engine.step", 0.0)
    return [forward, spent["autograd"], around, step, total - forward - spent["autograd"] - around - step]


def step_phases(bare, trainer, batch, rounds: int) -> list[tuple[str, float, float]]:
    """(phase, bare host ms, DeepSpeed host ms) by `_PHASES`: medians over `rounds` interleaved rounds."""
    import statistics

    from agentrl.trainer import forward, policy_trainer

    per_round: list[tuple[list[float], list[float]]] = []
    for _ in range(rounds):
        with phase_clock([(torch.Tensor, "backward", "autograd"),
                          (forward, "micro_batch_loss", "forward")]) as spent:
            _, total = host_seconds(bare)
        bare_phases = _phases_of(total, spent)
        with phase_clock([(torch.Tensor, "backward", "autograd"), (policy_trainer, "micro_batch_loss", "forward"),
                          (trainer.engine, "backward", "engine.backward"),
                          (trainer.engine, "step", "engine.step")]) as spent:
            _, total = host_seconds(lambda: trainer.step(batch))
        per_round.append((bare_phases, _phases_of(total, spent)))
    return [(phase, statistics.median(b[i] for b, _ in per_round) * 1e3,
             statistics.median(d[i] for _, d in per_round) * 1e3) for i, phase in enumerate(_PHASES)]


def bench_host_time(preset: str, tokens: int, rounds: int, variants: list[str], profile: int = 0,
                    phases: bool = False) -> None:
    """Wall time of DeepSpeed's step against the bare forward + backward, timed on CPU with the preset's structure
    at negligible widths (`narrow_config`): the host's own cost of each, which a GPU's short step is bound by. With
    `phases`, each step's host time is also split by `_PHASES` over as many more rounds; with `profile`, each
    variant's DeepSpeed functions by cumulative time over 5 more steps under cProfile (top `profile`)."""
    import cProfile
    import pstats
    import statistics

    _one_rank_rendezvous()
    from bench_gpu import _deepspeed_trainer, _trainer_batch, bare_step  # bench_gpu's trainer table, its variants

    config = narrow_config(preset)
    batch = _trainer_batch(config.vocab_size, tokens, prompt=4)
    torch.set_num_threads(1)  # one thread issues a GPU step's work; a pool's hand-offs would be CPU's own cost

    rows, phase_rows = [], []
    with cuda_form():
        model = bare_model(config)
        _, bare = bare_step(model, batch, tokens, device="cpu")
        for what in variants:
            with tempfile.TemporaryDirectory() as run_dir:
                trainer = _deepspeed_trainer(what, config, tokens, run_dir)
                steps = (bare, lambda: trainer.step(batch))
                for step in steps:  # warm-up: ZeRO-3 records its parameter trace over the first steps
                    step(), step()
                times: list[list[tuple[float, float]]] = [[], []]  # (wall, host) per round, bare and step
                for _ in range(rounds):  # interleaved: what drifts over the run hits both alike
                    for step, out in zip(steps, times):
                        out.append(host_seconds(step))
                if phases:
                    phase_rows += [[what, phase, f"{b:.1f}", f"{d:.1f}", f"{d - b:+.1f}"]
                                   for phase, b, d in step_phases(bare, trainer, batch, rounds)]
                if profile:
                    profiler = cProfile.Profile()
                    profiler.runcall(lambda: [trainer.step(batch) for _ in range(5)])
                    print(f"\n#### {what}: DeepSpeed's functions over 5 steps under cProfile (its overhead included)")
                    pstats.Stats(profiler).sort_stats("cumulative").print_stats("deepspeed/", profile)
                trainer.close()
            (bare_ms, step_ms), (bare_host_ms, step_host_ms) = (
                [statistics.median(t[i] for t in ts) * 1e3 for ts in times] for i in (0, 1))
            ratios = sorted(b[1] / d[1] for b, d in zip(*times))
            rows.append([what, f"{bare_ms:.1f}", f"{bare_host_ms:.1f}", f"{step_ms:.1f}", f"{step_host_ms:.1f}",
                         f"{step_host_ms - bare_host_ms:+.1f}",
                         f"{statistics.median(ratios):.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})"])
            print(f"  {what}: bare {bare_ms:.1f} ms ({bare_host_ms:.1f} host), step {step_ms:.1f} ms "
                  f"({step_host_ms:.1f} host)", flush=True)
    print(f"\n### Host time of one training step on CPU: the `{preset}` preset's structure at negligible widths "
          f"({sum(1 for _ in model.parameters())} parameters), {tokens} tokens, one rank, one thread, CPU in the "
          f"CUDA form, median of {rounds} interleaved rounds\n")
    print("(host: the wall time less the stand-ins' reference compute, which on a GPU is its kernels' work)\n")
    print(markdown_table(["step", "bare fwd+bwd (ms)", "of it host", "DeepSpeed step (ms)", "of it host",
                          "host over bare (ms)", "bare / step, host (range)"], rows))
    if phase_rows:
        print(f"\n### Where the host time goes, by phase (medians of {rounds} more interleaved rounds)\n")
        print(markdown_table(["step", "phase", "bare, host ms", "DeepSpeed, host ms", "over bare"], phase_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=None, help="512 per layer; 1024 for --trainer")
    parser.add_argument("--checkpointing", action="store_true", help="the layer's forward recomputed in backward")
    parser.add_argument("--trainer", action="store_true", help="DeepSpeed's step against the bare one")
    parser.add_argument("--top", type=int, default=12, help="--trainer: call sites listed per stage")
    parser.add_argument("--host-time", nargs="*", default=None, metavar="VARIANT",
                        help="time DeepSpeed's step against the bare one at negligible widths (default 64 tokens), "
                             "for these of bench_gpu's TRAINER_VARIANTS (default: zero2 zero3)")
    parser.add_argument("--rounds", type=int, default=15, help="--host-time: interleaved rounds")
    parser.add_argument("--phases", action="store_true", help="--host-time: also split each step's host time "
                        "by phase (forward, backward, DeepSpeed's backward epilogue, optimizer step, the rest)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="--host-time: also list each variant's TOP DeepSpeed functions by cumulative time")
    args = parser.parse_args()
    if args.host_time is not None:
        from bench_gpu import TRAINER_VARIANTS

        if unknown := [v for v in args.host_time if v not in TRAINER_VARIANTS]:
            parser.error(f"unknown --host-time variants {unknown}; known: {', '.join(map(repr, TRAINER_VARIANTS))}")
        bench_host_time(args.preset, args.tokens or 64, args.rounds, args.host_time or ["zero2", "zero3"],
                        args.profile, args.phases)
    elif args.trainer:
        bench_trainer(args.preset, args.tokens or 1024, args.top)
    else:
        bench_layers(args.preset, args.tokens or 512, args.checkpointing)


if __name__ == "__main__":
    main()
