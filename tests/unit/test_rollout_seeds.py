"""Per-episode sampling seeds (agent_loop.sampling_seed) and the engines that cannot honour them."""

import pytest

from agentrl.chat.agentrl_format import AgentRLFormat
from agentrl.rollout.agent_loop import AgentLoop, sampling_seed
from agentrl.rollout.config import RolloutConfig


def test_sampling_seeds_are_stable_and_distinct_per_episode_and_position():
    seeds = {(episode, position): sampling_seed(episode, position) for episode in range(50) for position in range(50)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2**62 for s in seeds.values())
    assert sampling_seed(7, 23) == seeds[7, 23]



class _UnseededEngine:
    seeded_sampling = False


def test_an_engine_without_per_request_seeds_is_refused_unless_seeding_is_off():
    with pytest.raises(ValueError, match="rollout.seeded_sampling=false"):
        AgentLoop(_UnseededEngine(), AgentRLFormat(stop_ids=[0]), RolloutConfig(seeded_sampling=True))
    AgentLoop(_UnseededEngine(), AgentRLFormat(stop_ids=[0]), RolloutConfig(seeded_sampling=False))
