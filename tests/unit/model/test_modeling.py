"""The whole model: decoding equals the full forward, packing leaks nothing, log-probs, checkpoints, training."""

import tempfile

import pytest
import torch

from agentrl.model.config import HybridMoEConfig, preset_config
from agentrl.model.modeling import HybridMoEForCausalLM, chunked_token_logprobs
from tests.unit.model.conftest import tiny_model

VARIANTS = {
    "k3": {},
    "kimi-linear": dict(attn_res_block_size=None, mla_use_output_gate=False,
                        linear_attn_config=dict(gate_lower_bound=None, use_full_rank_gate=False)),
    "latent-situ": dict(routed_expert_hidden_size=32, latent_moe_use_norm=True, hidden_act="situ",
                        activation_situ_beta=2.0, activation_situ_linear_beta=4.0, q_lora_rank=24),
    "attnres-per-layer": dict(attn_res_block_size=1, num_expert_group=2, topk_group=1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_then_decode_equals_full_forward(variant):
    model = tiny_model(**VARIANTS[variant]).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 29))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :17], use_cache=True)
        pieces, cache = [out.logits], out.cache
        out = model(ids[:, 17:21], cache=cache, use_cache=True)  # a multi-token continuation (chunked prefill)
        pieces.append(out.logits)
        for t in range(21, 29):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=1e-4)
    assert cache.seq_lens.tolist() == [29, 29]


def test_packed_sequences_equal_separate_forwards():
    model = tiny_model().eval()
    lengths = [7, 1, 23, 16]
    seqs = [torch.randint(0, 512, (n,)) for n in lengths]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(seqs), cu_seqlens=cu)
        for s, (start, end) in zip(seqs, zip(cu[:-1].tolist(), cu[1:].tolist())):
            alone = model(s[None])
            torch.testing.assert_close(packed.logits[start:end], alone.logits[0], atol=2e-5, rtol=1e-4)
            assert torch.equal(packed.routed_experts[start:end], alone.routed_experts)


def test_packed_gradients_equal_separate_gradients():
    model = tiny_model()
    seqs = [torch.randint(0, 512, (n,)) for n in (9, 20)]
    cu = torch.tensor([0, 9, 29], dtype=torch.int32)
    ids = torch.cat(seqs)
    targets = torch.roll(ids, -1)
    model(ids, cu_seqlens=cu, target_ids=targets).token_logprobs.sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for s, t in zip(seqs, torch.split(targets, [9, 20])):
        model(s[None], target_ids=t[None]).token_logprobs.sum().backward()
    for name, p in model.named_parameters():
        if name in packed:
            torch.testing.assert_close(p.grad, packed[name], atol=1e-5, rtol=1e-4, msg=name)


def test_token_logprobs_match_full_log_softmax_and_its_gradients():
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 33))
    out = model(ids[:, :-1], target_ids=ids[:, 1:], temperature=0.7, return_entropy=True)
    logits = model(ids[:, :-1]).logits / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(out.token_logprobs, ref, atol=1e-5, rtol=1e-5)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(out.entropy, -(probs * torch.log_softmax(logits, -1)).sum(-1), atol=1e-5, rtol=1e-5)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (50,))
    lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=7)
    lp.sum().backward()
    g_h, g_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    torch.log_softmax(hidden @ weight.t(), -1).gather(-1, targets[:, None]).sum().backward()
    torch.testing.assert_close(g_h, hidden.grad)
    torch.testing.assert_close(g_w, weight.grad)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, weight, targets, temperature=0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("uses", ["both", "logprobs", "entropy"])
@pytest.mark.parametrize("tokens, vocab", [(37, 50), (60, 23)], ids=["by-vocabulary", "by-tokens"])
def test_log_prob_head_gradients_match_autograd_over_the_full_softmax(temperature, uses, tokens, vocab):
    """The hand-written backward of the chunked head against autograd through the whole log-softmax in fp64, for
    every mix of the two outputs a loss can use (an entropy bonus, the policy term, both), across chunk borders:
    fewer tokens than the vocabulary (the backward slices the vocabulary, 10 columns at a time here) and more
    (it chunks the tokens)."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    targets[:3] = torch.tensor([0, vocab - 1, 10])  # the first and last columns, and a slice border
    g_lp, g_h = torch.randn(tokens, dtype=torch.float64), torch.randn(tokens, dtype=torch.float64)

    def loss(lp, ent):
        return ((lp * g_lp).sum() if uses != "entropy" else 0) + ((ent * g_h).sum() if uses != "logprobs" else 0)

    lp, ent = chunked_token_logprobs(hidden, weight, targets, temperature, return_entropy=True, chunk_tokens=8)
    loss(lp, ent).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    log_p = torch.log_softmax(hidden @ weight.t() / temperature, -1)
    ref_lp, ref_ent = log_p.gather(-1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(lp, ref_lp)  # fp64 inputs: the head computes in fp64, so fp64 tolerances
    torch.testing.assert_close(ent, ref_ent)
    loss(ref_lp, ref_ent).backward()
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], weight.grad)


def test_log_prob_head_chunks_by_vocabulary_size_and_keeps_no_grad_calls_cheap():
    hidden, weight = torch.randn(10, 8), torch.randn(30, 8)
    targets = torch.randint(0, 30, (10,))
    whole, _ = chunked_token_logprobs(hidden, weight, targets)  # default chunk: all 10 tokens at once
    pieces, none = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=3)
    torch.testing.assert_close(whole, pieces)
    assert none is None and not whole.requires_grad


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 20))
    model(ids, target_ids=ids).token_logprobs.sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model.train()
    model(ids, target_ids=ids).token_logprobs.sum().backward()
    for n, p in model.named_parameters():
        if n in ref:
            torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5, msg=n)


def test_checkpoint_round_trip_is_exact_and_strict():
    model = tiny_model(routed_expert_hidden_size=32, latent_moe_use_norm=True)
    with torch.no_grad():
        for moe in model.moe_layers:
            moe.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        loaded = HybridMoEForCausalLM.from_pretrained(d)
        a, b = model.state_dict(), loaded.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert loaded.config.to_dict()["linear_attn_config"] == model.config.linear_attn_config
        # a checkpoint for another shape is refused, naming the mismatch
        other = tiny_model(num_experts=4, num_experts_per_token=2)
        other.save_pretrained(d)
        with pytest.raises((ValueError, RuntimeError)):
            from agentrl.model.checkpoint import load_checkpoint_tensors, load_state_into
            load_state_into(model, load_checkpoint_tensors(d))


def test_checkpoint_shards_with_an_index(tmp_path):
    from agentrl.model.checkpoint import save_checkpoint
    model = tiny_model()
    names = save_checkpoint(model, str(tmp_path), shard_bytes=200_000)
    assert len(names) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    loaded = HybridMoEForCausalLM.from_pretrained(str(tmp_path))
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])


def test_k3_preset_on_meta_counts_published_totals():
    with torch.device("meta"):
        model = HybridMoEForCausalLM(preset_config("k3"))
    total, active = model.parameter_counts()
    assert abs(total / 2.78e12 - 1) < 0.01, total
    assert abs(active / 104.2e9 - 1) < 0.01, active
    cfg = model.config
    kda = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    assert (kda, cfg.num_hidden_layers - kda) == (69, 24) and not cfg.is_kda_layer(92)


def test_small_presets_have_the_advertised_sizes():
    tiny_total, _ = tiny_model().parameter_counts()
    assert tiny_total < 5e6
    with torch.device("meta"):
        small = HybridMoEForCausalLM(preset_config("small"))
    assert 1e8 < small.parameter_counts()[0] < 1e9


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act"),
    ("num_experts_per_token", 8, "num_experts_per_token"),
    ("moe_balancing", "aux-loss", "moe_balancing"),
    ("attn_res_block_size", 0, "attn_res_block_size"),
    ("linear_attn_config", dict(gate_lower_bound=-7.0), "gate_lower_bound"),
    ("linear_attn_config", dict(kda_layers=[1, 2]), "partition"),
    ("mla_use_nope", False, "NoPE"),
    ("initializer_range", 0.0, "initializer_range"),
    ("embedding_init_std", -1.0, "embedding_init_std"),
])
def test_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        preset_config("tiny", **{field: value})
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_config("gpt-5")


def test_config_is_vllm_kimi_linear_shaped():
    cfg = preset_config("tiny")
    d = cfg.to_dict()
    assert d["model_type"] == "kimi_linear" and d["architectures"] == ["KimiLinearForCausalLM"]
    for key in ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size",
                "gate_lower_bound", "use_full_rank_gate"):
        assert key in d["linear_attn_config"]
    assert HybridMoEConfig.from_dict(d).to_dict() == d


def test_generation_is_deterministic_and_uses_the_cache():
    model = tiny_model().eval()
    prompt = torch.randint(0, 512, (3, 5))
    a = model.generate_tokens(prompt, 12)
    b = model.generate_tokens(prompt, 12)
    assert torch.equal(a, b) and a.shape == (3, 17)
    # greedy generation equals argmax of the full forward at every step
    with torch.no_grad():
        logits = model(a[:, :-1]).logits
    assert torch.equal(logits[:, 4:].argmax(-1), a[:, 5:])


def test_tiny_model_overfits_a_small_batch():
    model = tiny_model()
    ids = torch.randint(0, 512, (4, 24))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = -model(ids[:, :-1], target_ids=ids[:, 1:]).token_logprobs.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_expert_bias()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses[::10]


def test_embedding_init_std_sets_the_embeddings_alone():
    default = tiny_model()
    assert default.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    wide = tiny_model(initializer_range=0.125, embedding_init_std=1.0)
    assert wide.model.embed_tokens.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert wide.lm_head.weight.std().item() == pytest.approx(0.125, rel=0.05)
    assert wide.config.to_dict()["embedding_init_std"] == 1.0  # saved with the checkpoint's config
