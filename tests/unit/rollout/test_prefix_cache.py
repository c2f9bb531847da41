"""What a trajectory records of vLLM's prefix cache, per generation call, and the rates the job logs from it."""

from agentrl.driver import rollout_metrics
from agentrl.rollout.agent_loop import prefix_cache_stats
from agentrl.types import Trajectory


def episode(tid: str, calls: list[list[int]]) -> Trajectory:
    t = Trajectory(trajectory_id=tid, task_id="0", group_id="g", env_id="toy", prefix_cache=calls)
    t.append_prompt([1, 2, 3])
    t.append_sampled([4], [0.0], 0)
    return t


def test_reuse_counts_only_what_the_engine_ran_for_the_episode_before():
    # call 1: a 100-token prompt, 20 sampled, 96 cached (another episode's shared system prompt); call 2: 130 tokens
    # (the 119 the engine ran, the last sampled token, the tool's 10), 96 cached; call 3 after a weight update: none
    a = episode("a", [[100, 20, 96], [130, 20, 96], [160, 5, 0]])
    b = episode("b", [[50, 10, 0]])  # one turn: nothing to reuse
    stats = prefix_cache_stats([a, b])
    assert stats == {"prompt_tokens": 440, "cached_tokens": 192, "reusable_tokens": 119 + 149, "reused_tokens": 96}
    assert prefix_cache_stats([a.summary(), b.summary()]) == stats  # what the driver computes it from
    metrics = rollout_metrics([a.summary(), b.summary()])
    assert metrics["rollout/prefix_cache_hit_rate"] == 192 / 440
    assert metrics["rollout/prefix_reuse"] == 96 / 268


def test_cached_tokens_beyond_the_episodes_own_count_as_hits_not_reuse():
    stats = prefix_cache_stats([episode("a", [[64, 8, 0], [80, 8, 80]])])  # a prompt another request cached whole
    assert (stats["reusable_tokens"], stats["reused_tokens"], stats["cached_tokens"]) == (71, 71, 80)


def test_no_record_no_rate():
    assert "rollout/prefix_reuse" not in rollout_metrics([episode("a", []).summary()])
    assert "rollout/prefix_cache_hit_rate" not in rollout_metrics([episode("a", []).summary()])
