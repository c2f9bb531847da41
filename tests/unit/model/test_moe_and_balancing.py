"""MoE routing (selection-only bias, grouped dispatch, routing replay) and Quantile Balancing."""

import pytest
import torch

from agentrl.model.balancing import (ExpertBalancer, competitor_threshold, count_values, exact_quantile_bias,
                                     histogram_quantile, margin_range, update_biases)
from agentrl.model.config import preset_config
from agentrl.model.moe import Router, SparseMoE, combine, dispatch, grouped_matmul, sort_by_expert


def skewed_router(num_experts=16, top_k=2, method="quantile", hidden=32) -> Router:
    cfg = preset_config("tiny", hidden_size=hidden, num_experts=num_experts, num_experts_per_token=top_k,
                        moe_balancing=method, moe_balancing_sign_rate=0.02)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.3)
    with torch.no_grad():
        router.weight[:3] += 0.25  # three experts score high for every token: a heavily skewed router
    return router.train()


def load_ratio(router: Router, x: torch.Tensor) -> float:
    with torch.no_grad():
        _, idx = router(x)
    load = torch.bincount(idx.reshape(-1), minlength=router.num_experts).float()
    return (load.max() / load.mean()).item()


def test_quantile_balancing_flattens_a_skewed_router_within_a_few_steps():
    torch.manual_seed(0)
    router = skewed_router()
    x = lambda: torch.randn(16384, 32) + 0.5  # noqa: E731  (a shared mean makes the skew systematic)
    ratios = [load_ratio(router, x())]
    for _ in range(4):
        router(x())  # a training step's forward: the balancer observes
        router.update_bias()
        ratios.append(load_ratio(router, x()))
    assert ratios[0] > 3.0, ratios
    assert ratios[-1] < 1.1, ratios
    assert abs(router.e_score_correction_bias.mean().item()) < 1e-6  # b = b̂ − mean(b̂)


def test_sign_rule_variant_reduces_the_skew():
    torch.manual_seed(0)
    router = skewed_router(method="sign")
    x = torch.randn(2048, 32) + 0.5
    before = load_ratio(router, x)
    for _ in range(60):
        router(x)
        router.update_bias()
    assert load_ratio(router, x) < 0.6 * before


def test_bias_selects_but_never_enters_the_gate_weights():
    torch.manual_seed(0)
    router = skewed_router().eval()
    x = torch.randn(64, 32)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 16))
        weights, idx = router(x)
        scores = torch.sigmoid(x @ router.weight.t())
        picked = scores.gather(1, idx)
        torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True) * router.scaling)
        assert torch.equal(idx.sort(-1).values, (scores + router.e_score_correction_bias).topk(2).indices.sort(-1).values)
        # the bias moved the selection away from the unbiased top-k for some tokens
        assert not torch.equal(idx.sort(-1).values, scores.topk(2).indices.sort(-1).values)


def test_histogram_quantile_matches_the_exact_quantile_and_sums_across_ranks():
    torch.manual_seed(0)
    scores = torch.sigmoid(torch.randn(3000, 12) * 1.5 + torch.linspace(-1, 1, 12))
    bias = torch.randn(12) * 0.1
    exact = exact_quantile_bias(scores, bias, top_k=3)
    whole = ExpertBalancer(num_experts=12, top_k=3, num_bins=4096)
    ranks = [ExpertBalancer(num_experts=12, top_k=3, num_bins=4096) for _ in range(2)]
    idx = scores.topk(3).indices
    whole.observe(scores, bias, idx)
    for rank, part in zip(ranks, torch.chunk(torch.arange(3000), 2)):
        rank.observe(scores[part], bias, idx[part])
    lo, hi = margin_range(float(bias.max()), float(bias.min()))
    bin_width = (hi - lo) / 4096
    from_hist = whole.update(bias)
    assert (from_hist - exact).abs().max() < 2 * bin_width
    # two ranks: the all-reduce sums rank 1's packed histogram into rank 0's
    packed_other = torch.cat([ranks[1].hist_EB.reshape(-1), ranks[1].load_E])
    summed = ranks[0].update(bias, all_reduce=lambda t: t.add_(packed_other))
    torch.testing.assert_close(summed, from_hist)
    assert ranks[0].last_stats.load_E.sum() == 3000 * 3


def test_histogram_quantile_interpolates_inside_a_bin():
    hist = torch.tensor([[0.0, 10.0, 10.0, 0.0]])
    assert histogram_quantile(hist, 0.0, 4.0, 0.5).item() == pytest.approx(2.0)
    assert histogram_quantile(hist, 0.0, 4.0, 0.25).item() == pytest.approx(1.5)


def test_balancer_rejects_bad_settings():
    with pytest.raises(ValueError, match="balancing method"):
        ExpertBalancer(num_experts=8, top_k=2, method="aux")
    with pytest.raises(ValueError, match="top_k"):
        ExpertBalancer(num_experts=8, top_k=8)


def test_grouped_matmul_equals_a_per_expert_loop():
    torch.manual_seed(0)
    w = torch.randn(5, 6, 4)
    counts = torch.tensor([3, 0, 4, 1, 2])
    x = torch.randn(int(counts.sum()), 4)
    ref = torch.cat([x[s:e] @ w[i].t() for i, (s, e) in
                     enumerate(zip([0, *counts.cumsum(0)[:-1].tolist()], counts.cumsum(0).tolist())) if e > s])
    torch.testing.assert_close(grouped_matmul(x, w, counts), ref)


@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_dispatch_and_combine_equal_indexing_and_a_scatter_add_with_their_gradients(num_tokens):
    torch.manual_seed(0)
    num_experts, top_k, width = 6, 3, 5
    experts = torch.rand(num_tokens, num_experts).argsort(-1)[:, :top_k]  # K distinct experts per token
    x = torch.randn(num_tokens, width, dtype=torch.float64, requires_grad=True)
    w = torch.rand(num_tokens, top_k, dtype=torch.float64, requires_grad=True)
    order = sort_by_expert(experts, num_experts)
    assert order.counts_E.tolist() == torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
    pair_of_row = order.pair_of_row_S
    token_of_row = pair_of_row // top_k
    rows = dispatch(x, order)
    # rows come grouped by expert, each the row of its token
    assert torch.equal(experts.reshape(-1)[pair_of_row], experts.reshape(-1).sort(stable=True).values)
    assert torch.equal(order.row_of_pair_TK.reshape(-1)[pair_of_row], torch.arange(num_tokens * top_k))
    assert torch.equal(rows, x[token_of_row])
    out_rows = torch.tanh(rows) * torch.arange(1, rows.shape[0] + 1, dtype=rows.dtype)[:, None]
    y = combine(out_rows, w, order)
    ref = torch.zeros_like(x).index_add(0, token_of_row, out_rows * w.reshape(-1)[pair_of_row, None])
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    grads = torch.autograd.grad((y * g).sum(), (x, w))
    x_ref = x.detach().requires_grad_()
    rows_ref = x_ref[token_of_row]
    out_ref = torch.tanh(rows_ref) * torch.arange(1, rows_ref.shape[0] + 1, dtype=x.dtype)[:, None]
    y_ref = torch.zeros_like(x_ref).index_add(0, token_of_row, out_ref * w.reshape(-1)[pair_of_row, None])
    for got, want in zip(grads, torch.autograd.grad((y_ref * g).sum(), (x_ref, w))):
        torch.testing.assert_close(got, want)


def test_moe_equals_the_dense_sum_over_chosen_experts_and_replays_routing():
    torch.manual_seed(0)
    cfg = preset_config("tiny", routed_expert_hidden_size=24, latent_moe_use_norm=True)
    moe = SparseMoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.eval()
    x = torch.randn(20, cfg.hidden_size)
    with torch.no_grad():
        y, experts = moe(x)
        weights, idx = moe.gate(x)
        z = moe.routed_expert_down_proj(x)
        ref = torch.zeros_like(z)
        for t in range(20):
            for k in range(idx.shape[1]):
                e = idx[t, k]
                w1, w3 = moe.experts.w13_weight[e].chunk(2)
                h = torch.nn.functional.silu(z[t] @ w1.t()) * (z[t] @ w3.t())
                ref[t] += weights[t, k] * (h @ moe.experts.w2_weight[e].t())
        ref = moe.routed_expert_up_proj(moe.routed_expert_norm(ref)) + moe.shared_experts(x)
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-4)
        assert torch.equal(experts, idx)
        # routing replay: forcing the captured experts reproduces the output; forcing others changes it
        replay, used = moe(x, forced_experts_TK=experts)
        torch.testing.assert_close(replay, y)
        other = (experts + 1) % cfg.num_experts
        changed, used = moe(x, forced_experts_TK=other)
        assert torch.equal(used, other) and not torch.allclose(changed, y)
        with pytest.raises(ValueError, match="forced experts"):
            moe(x, forced_experts_TK=experts[:, :1])


def test_model_level_routing_replay_reproduces_logits():
    from tests.unit.model.conftest import tiny_model
    model = tiny_model().eval()
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        out = model(ids)
        replay = model(ids, forced_experts=out.routed_experts)
    torch.testing.assert_close(replay.logits, out.logits)
    assert out.routed_experts.shape == (32, len(model.moe_layers), model.config.num_experts_per_token)


@pytest.mark.parametrize("size, n", [(0, 4), (1, 1), (1000, 7), (4096, 256)])
def test_count_values_equals_bincount(size, n):
    values = torch.randint(0, n, (size,), generator=torch.Generator().manual_seed(size))
    got = count_values(values, n)
    assert got.dtype == torch.long and got.tolist() == torch.bincount(values, minlength=n).tolist()


def test_competitor_threshold_is_the_kth_best_of_the_other_experts_even_with_ties():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(200, 10, generator=gen)
    scores[:50] = torch.round(scores[:50] * 4) / 4  # coarse values: ties across the top-K boundary
    scores[50:60] = 1.0  # a saturated router: every expert ties
    for top_k in (1, 3, 9):
        others = scores[:, None, :].expand(-1, 10, -1).clone()
        others[:, torch.arange(10), torch.arange(10)] = float("-inf")  # expert j left out of row j
        brute = others.topk(top_k, dim=-1).values[..., -1]
        assert torch.equal(competitor_threshold(scores, top_k), brute)


def test_the_histogram_range_follows_a_bias_written_in_place():
    """observe keeps the histogram's range per bias; an update written into the same tensor must move it, as a new
    bias tensor does."""
    gen = torch.Generator().manual_seed(1)
    scores = [torch.sigmoid(torch.randn(300, 12, generator=gen)) for _ in range(2)]
    biases = [torch.zeros(12), torch.randn(12, generator=gen) * 0.5]
    in_place, fresh = (ExpertBalancer(num_experts=12, top_k=3, num_bins=256) for _ in range(2))
    bias = biases[0].clone()
    for step, (step_scores, step_bias) in enumerate(zip(scores, biases)):
        if step == 0:
            bias.copy_(step_bias)
        else:  # as the model's update_expert_bias writes every layer's bias at once
            torch._foreach_copy_([bias], [step_bias])
        in_place.observe(step_scores, bias, (step_scores + bias).topk(3).indices)
        fresh.observe(step_scores, step_bias.clone(), (step_scores + step_bias).topk(3).indices)
    assert in_place.hist_EB.sum() == 2 * 300 * 12 and in_place.load_E.sum() == 2 * 300 * 3
    assert torch.equal(in_place.hist_EB, fresh.hist_EB) and torch.equal(in_place.load_E, fresh.load_E)
    # and the bins are those of the margins under each step's own range
    want = torch.zeros(12, 256, dtype=torch.long)
    for step_scores, step_bias in zip(scores, biases):
        lo, hi = margin_range(float(step_bias.max()), float(step_bias.min()))
        margins = step_scores - competitor_threshold(step_scores + step_bias, 3)
        for e in range(12):
            want[e] += torch.histc(margins[:, e].double(), bins=256, min=lo, max=hi).long()
    assert (in_place.hist_EB - want).abs().sum() <= 2  # histc and the bin arithmetic may round a boundary apart


def _observed_balancers(seed: int, methods=("quantile", "sign", "quantile", "none")):
    """Balancers of a few layers (different methods and expert counts), each having seen one forward's routing."""
    gen = torch.Generator().manual_seed(seed)
    balancers, biases = [], []
    for layer, method in enumerate(methods):
        num_experts = 12 + 4 * layer
        scores = torch.sigmoid(torch.randn(500, num_experts, generator=gen) + torch.linspace(-1, 1, num_experts))
        bias = torch.randn(num_experts, generator=gen) * 0.1
        balancer = ExpertBalancer(num_experts=num_experts, top_k=3, method=method, num_bins=512, sign_rate=0.01)
        balancer.observe(scores, bias, (scores + bias).topk(3).indices)
        balancers.append(balancer)
        biases.append(bias)
    return balancers, biases


def test_all_layers_update_from_one_collective_as_each_would_alone():
    balancers, biases = _observed_balancers(0)
    alone = [b.update(bias) for b, bias in zip(*_observed_balancers(0))]
    calls = []
    together = update_biases(balancers, biases, all_reduce=lambda t: calls.append(t.numel()))
    assert len(calls) == 1 and calls[0] == 12 * 513 + 16 + 20 * 513  # both histograms and three load vectors
    assert together[3] is None and alone[3] is None  # "none" balances nothing
    for got, want in zip(together[:3], alone[:3]):
        torch.testing.assert_close(got, want)
    # reset for the next step, in place: a captured forward keeps adding into the same counters
    counters = [(b.load_E, b.hist_EB) for b in balancers[:3]]
    assert all(load.sum() == 0 and (hist is None or hist.sum() == 0) for load, hist in counters)
    for b, (load, _) in zip(balancers, counters):
        b.observe(torch.rand(10, b.num_experts), torch.zeros(b.num_experts), torch.zeros(10, 3, dtype=torch.long))
        assert b.load_E is load and b.load_E.sum() == 30
    assert balancers[3].load_E is None  # "none" counts nothing
    assert balancers[0].last_stats.load_E.sum() == 500 * 3
    # the quantile layers against the exact quantile of their margins
    gen = torch.Generator().manual_seed(0)
    scores = torch.sigmoid(torch.randn(500, 12, generator=gen) + torch.linspace(-1, 1, 12))
    exact = exact_quantile_bias(scores, biases[0], top_k=3)
    assert (together[0] - exact).abs().max() < 2 * (2.0 + 2 * biases[0].abs().max()) / 512


def test_a_rank_that_observed_nothing_still_joins_the_collective_and_gets_the_same_bias():
    """Rank 1 ran only padding micro-batches: it must all-reduce zeros of the same size (not skip the collective,
    which would pair its next one with rank 0's) and come out with rank 0's biases."""
    observed, biases = _observed_balancers(1)
    idle = [ExpertBalancer(num_experts=b.num_experts, top_k=3, method=b.method, num_bins=512, sign_rate=0.01)
            for b in observed]
    from_rank0 = torch.cat([b._packed(torch.device("cpu")) for b in observed if b.method != "none"])
    sent = []

    def receive_rank0(t):
        sent.append(t.clone())
        t.add_(from_rank0)

    got_idle = update_biases(idle, biases, all_reduce=receive_rank0)
    got_observed = update_biases(observed, biases, all_reduce=lambda t: t.add_(sent[0]))
    assert len(sent) == 1 and sent[0].shape == from_rank0.shape and not sent[0].any()
    for a, b in zip(got_idle, got_observed):
        assert (a is None and b is None) or torch.equal(a, b)
    assert got_idle[0] is not None and got_idle[1] is not None
    # no rank routed anything: every layer keeps its bias
    assert update_biases(idle, biases, all_reduce=lambda t: None) == [None] * 4
