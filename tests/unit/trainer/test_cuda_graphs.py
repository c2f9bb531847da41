"""The CPU-checkable parts of replaying short micro-batches from CUDA graphs (trainer/cuda_graphs.py): the fixed-size
chunk list, the padding and what the model makes of it, the balancers' token mask, and the setups it refuses. The
capture and replay themselves: tests/gpu/test_cuda_graphs.py."""

import pytest
import torch

from agentrl.model.balancing import ExpertBalancer
from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM, chunked_token_logprobs
from agentrl.model.static_shapes import active, conv_chunk_indices, static_shapes
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.cuda_graphs import pad_micro_batch


def _chunks_by_loop(lengths: list[int], chunk: int) -> list[tuple[int, int]]:
    return [(n, c) for n, length in enumerate(lengths) for c in range(-(-length // chunk))]


@pytest.mark.parametrize("lengths", [[5, 0, 130, 64, 1, 0, 0], [200, 0], [0, 0, 0], [63, 64, 65, 0]])
def test_the_fixed_chunk_list_is_the_real_chunks_then_rows_of_the_empty_last_sequence(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    num_tokens = int(cu[-1])
    got = conv_chunk_indices(cu, 64, num_tokens)
    real = _chunks_by_loop(lengths, 64)
    assert got.shape == (-(-num_tokens // 64) + len(lengths) - 1, 2) and got.dtype == torch.long
    assert [tuple(row) for row in got[:len(real)].tolist()] == real
    assert (got[len(real):, 0] == len(lengths) - 1).all() and (got[len(real):, 1] == 0).all()


def test_the_static_shapes_flag_holds_inside_its_block_only():
    assert not active()
    with static_shapes():
        assert active()
    assert not active()


def test_a_balancer_leaves_out_the_tokens_it_is_told_not_to_count():
    gen = torch.Generator().manual_seed(0)
    scores = torch.sigmoid(torch.randn(40, 8, generator=gen))
    bias = torch.randn(8, generator=gen) * 0.05
    topk = (scores + bias).topk(2).indices
    counted = torch.arange(40) % 3 != 0
    masked, subset = (ExpertBalancer(num_experts=8, top_k=2, num_bins=64) for _ in range(2))
    masked.observe(scores, bias, topk, counted)
    subset.observe(scores[counted], bias, topk[counted])
    assert torch.equal(masked.load_E, subset.load_E) and torch.equal(masked.hist_EB, subset.hist_EB)
    assert masked.load_E.sum() == 2 * int(counted.sum())
    with static_shapes():  # the range recomputed from the bias and not kept (a replay could not refresh it)
        uncached = ExpertBalancer(num_experts=8, top_k=2, num_bins=64)
        uncached.observe(scores, bias, topk, counted)
    assert torch.equal(uncached.hist_EB, masked.hist_EB)
    assert uncached._binning_cache is None and masked._binning_cache is not None
    nothing = ExpertBalancer(num_experts=8, top_k=2, num_bins=64)
    nothing.observe(scores, bias, topk, torch.zeros(40, dtype=torch.bool))
    assert nothing.load_E.sum() == 0 and nothing.stats() is None


def test_padding_leaves_each_real_tokens_log_prob_and_the_balancers_counts_as_without_it():
    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config("tiny")).double().train()
    vocab = model.config.vocab_size
    lengths = [7, 20, 3]
    cu = torch.tensor([0, 7, 27, 30])
    ids, targets = torch.randint(0, vocab, (30,)), torch.randint(0, vocab, (30,))
    moe = model.moe_layers
    top_k = moe[0].gate.top_k

    def counts():
        return [m.gate.balancer.load_E.clone() for m in moe]

    hidden, routed = model.model(ids, cu)
    want = chunked_token_logprobs(hidden, model.lm_head.weight, targets, 1.0, return_entropy=True)
    want_counts = counts()
    for m in moe:
        m.gate.balancer.reset()
    padded = pad_micro_batch(ids, cu, targets, None, tokens=48, sequences=len(lengths) + 3,
                             moe_layers=len(moe), top_k=top_k)
    assert padded.cu_seqlens.tolist() == [0, 7, 27, 30, 48, 48, 48] and padded.input_ids_T.shape == (48,)
    assert padded.forced_experts_TLK.shape == (48, len(moe), top_k) and (padded.forced_experts_TLK == -1).all()
    assert padded.counted_T.sum() == 30 and padded.counted_T[:30].all()
    with static_shapes():
        hidden_p, routed_p = model.model(padded.input_ids_T, padded.cu_seqlens, None, False,
                                         padded.forced_experts_TLK, None, padded.counted_T)
    got = chunked_token_logprobs(hidden_p, model.lm_head.weight, padded.target_ids_T, 1.0, return_entropy=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g[:30], w, rtol=1e-10, atol=1e-10)
    assert torch.equal(routed_p[:30], routed)
    assert all(torch.equal(g, w) for g, w in zip(counts(), want_counts))
    # forced experts keep their rows; the padding's rows are −1 (the router's own choice)
    forced = pad_micro_batch(ids, cu, targets, routed, tokens=48, sequences=6, moe_layers=len(moe), top_k=top_k)
    assert torch.equal(forced.forced_experts_TLK[:30], routed) and (forced.forced_experts_TLK[30:] == -1).all()
    idle = pad_micro_batch(ids, cu, targets, None, tokens=48, sequences=6, moe_layers=len(moe), top_k=top_k,
                           counted=False)
    assert not idle.counted_T.any()


def test_padding_leaves_the_gradient_of_a_loss_with_advantages_of_both_signs_as_without_it():
    """The backward too is exact in arithmetic (fp64): a graphed step's gradient differs from the eager one only by
    rounding, which a GRPO gradient's cancellation magnifies in bf16 (docs/benchmarks.md, session 40)."""
    from agentrl.trainer.forward import PackedPolicy

    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config("tiny")).double().train()
    policy = PackedPolicy(model)
    cu = torch.tensor([0, 7, 27, 30])
    ids, targets = torch.randint(0, model.config.vocab_size, (2, 30))
    advantages = torch.tensor([1.0] * 7 + [-1.0] * 20 + [0.5] * 3, dtype=torch.float64)

    def gradient(logp, entropy):
        model.zero_grad(set_to_none=True)
        ((advantages * logp).sum() + 0.01 * entropy.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = gradient(*policy(ids, cu, targets))
    for tokens in (48, 30):  # 30: the micro-batch fills the bucket, its padding sequence is empty
        padded = pad_micro_batch(ids, cu, targets, None, tokens=tokens, sequences=6,
                                 moe_layers=len(model.moe_layers), top_k=model.moe_layers[0].gate.top_k)
        with static_shapes():
            logp, entropy = policy(padded.input_ids_T, padded.cu_seqlens, padded.target_ids_T,
                                   padded.forced_experts_TLK, counted_T=padded.counted_T)
        got = gradient(logp[:30], entropy[:30])
        assert got.keys() == want.keys() and len(want) > 10
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12, msg=f"{tokens} tokens: {name}")


def test_a_micro_batch_that_does_not_fit_is_refused():
    ids = torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="does not fit"):
        pad_micro_batch(ids, torch.tensor([0, 5, 10]), ids, None, tokens=8, sequences=8, moe_layers=1, top_k=2)
    with pytest.raises(ValueError, match="does not fit"):  # two sequences need four slots: theirs, padding, empty
        pad_micro_batch(ids, torch.tensor([0, 5, 10]), ids, None, tokens=16, sequences=3, moe_layers=1, top_k=2)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(zero_stage=3), "zero_stage=2"),
    (dict(context_parallel=2), "context or expert"),
    (dict(expert_parallel=2), "context or expert"),
    (dict(cuda_graph_tokens=(4096, 2048)), "increasing"),
    (dict(cuda_graph_tokens=(1,)), "increasing"),
    (dict(cuda_graph_sequences=2), "cuda_graph_sequences must be > 2"),  # no micro-batch would ever fit
])
def test_setups_a_graph_cannot_serve_are_refused_when_the_config_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig(**({"run_dir": "/tmp/x", "cuda_graph_tokens": (4096,)} | kwargs))
    TrainerConfig(run_dir="/tmp/x", cuda_graph_tokens=(2048, 4096), cuda_graph_sequences=3)
    asked_for_no_graphs = {k: v for k, v in kwargs.items() if not k.startswith("cuda_graph")}
    TrainerConfig(run_dir="/tmp/x", **asked_for_no_graphs)  # nothing to refuse


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a trainer without CUDA")
def test_a_trainer_without_cuda_refuses_graphs_before_it_joins_a_process_group(tmp_path):
    import torch.distributed as dist

    from agentrl.trainer import PolicyTrainer

    with pytest.raises(ValueError, match="needs a CUDA device"):
        PolicyTrainer(TrainerConfig(run_dir=str(tmp_path), cuda_graph_tokens=(64,)), preset_config("tiny"))
    assert not dist.is_initialized()


def test_a_position_replays_only_where_every_data_parallel_ranks_micro_batch_fits():
    """DeepSpeed's gradient buckets fill in arrival order, which a replay and an eager backward differ in: the
    ranks reducing one micro-batch's gradients must take the same path."""
    from types import SimpleNamespace

    from agentrl.trainer.cuda_graphs import GraphedForward

    graphs = GraphedForward(HybridMoEForCausalLM(preset_config("tiny")), buckets=(64, 128), max_sequences=6)

    def micro(tokens, sequences=1):
        return SimpleNamespace(num_tokens=tokens, num_sequences=sequences)

    per_rank = [[micro(100), micro(60), micro(2), micro(30, sequences=3)],
                [micro(120), micro(200), micro(50), micro(30, sequences=5)]]
    assert graphs.replayable(per_rank) == [True, False, True, False]
    assert graphs.replayable(per_rank[:1]) == [True, True, True, True]  # one rank: whatever fits
    with pytest.raises(ValueError):  # the plan gives every rank as many micro-batches
        graphs.replayable([per_rank[0], per_rank[1][:3]])
    ids = torch.zeros(30, dtype=torch.long)
    with graphs.allowing(False):  # declined before any recording: the caller runs it eagerly
        assert graphs(ids, torch.tensor([0, 30]), ids, None, 1.0) is None
        assert graphs.replays == graphs.recordings == 0
    assert graphs.allowed
    with pytest.raises(RuntimeError), graphs.allowing(False):
        raise RuntimeError("a failed micro-batch")
    assert graphs.allowed  # restored however the block ends


def test_the_job_config_takes_graph_buckets_from_the_command_line():
    from agentrl.config import load_config

    job, _ = load_config(None, ["trainer.cuda_graph_tokens=[2048,4096]", "trainer.cuda_graph_sequences=16"])
    assert job.trainer.cuda_graph_tokens == (2048, 4096) and job.trainer.cuda_graph_sequences == 16
    assert load_config(None, [])[0].trainer.cuda_graph_tokens == ()  # eager unless asked for
