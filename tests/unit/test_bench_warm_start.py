"""scripts/bench_warm_start.py's measure against a naive one: full logits, log-softmax at the temperature, the
oracle's sampled tokens picked out by hand."""

import math
import os

import torch

from agentrl.chat import load_chat_format
from agentrl.config import load_config
from agentrl.envs import make
from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.rollout.oracle import oracle_trajectory

from tests.scripts import ROOT, load_script

WARM_START = os.path.join(ROOT, "tests", "data", "quickstart-warm-start")


def _script():
    return load_script("bench_warm_start")


def test_the_oracle_sequence_probability_matches_a_naive_log_softmax_at_each_temperature():
    job, _ = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), ["env.eval_tasks=3"])
    got = _script().oracle_probabilities(WARM_START, job, [1.0, 0.5])

    model = HybridMoEForCausalLM.from_pretrained(WARM_START).eval()
    chat = load_chat_format(WARM_START, job.model.chat_format)
    env = make(job.env.id, **job.env.kwargs)
    for temperature in (1.0, 0.5):
        probabilities = []
        for i in range(job.env.train_tasks, job.env.num_tasks):
            t = oracle_trajectory(env, chat, env_id=job.env.id, task_index=i, seed=i, group_id="x")
            ids = torch.tensor(t.tokens)
            with torch.no_grad():
                logits = model(ids[None]).logits[0, :-1].double() / temperature
            logprobs = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
            sampled = [p for p, m in zip(logprobs.tolist(), t.loss_mask[1:]) if m]
            assert len(sampled) == sum(t.loss_mask)  # the first token is never sampled
            probabilities.append(math.exp(sum(sampled)))
        assert got[temperature]["tasks"] == 3
        assert abs(got[temperature]["sequence"] - sum(probabilities) / 3) < 1e-5
        assert got[temperature]["digits"] > 0 and 0 < got[temperature]["digit"] <= 1
    # a lower temperature sharpens: the likely oracle tokens of a trained policy gain probability
    assert got[0.5]["digit"] > got[1.0]["digit"]
