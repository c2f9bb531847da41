"""agentrl.reward: scorers, weighted components, format penalties and the failed-run rule."""

import math

import pytest

from agentrl.reward import (FAILED, RewardResult, exact_match, format_penalty, group_advantages, normalize_answer,
                            numeric_match, parse_number, unit_tests_passed, weighted_total)


@pytest.mark.parametrize("prediction, gold, score", [
    ("Paris", "paris", 1.0), ("  The  Answer. ", "the answer", 1.0), ('"VAL-1a"', "VAL-1a", 1.0),
    ("VAL-1b", "VAL-1a", 0.0), ("", "x", 0.0), ("Paris, France", "Paris", 0.0),
])
def test_exact_match(prediction, gold, score):
    assert exact_match(prediction, gold) == score


def test_exact_match_without_normalisation():
    assert exact_match("Paris", "paris", normalize=False) == 0.0 and exact_match("a", "a", normalize=False) == 1.0
    assert normalize_answer(" A  b. ") == "a b"


@pytest.mark.parametrize("text, value", [
    ("42", 42.0), ("The answer is 4,189.5 dollars.", 4189.5), ("$12", 12.0), ("12%", 12.0), ("3/4", 0.75),
    ("-2.5e3", -2500.0), ("first 3 then 7", 7.0), (".5", 0.5), ("no number", None), ("1/0", None), ("1e999", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_numeric_match_tolerances():
    assert numeric_match("4189.5", 4189.5) == 1.0
    assert numeric_match("4189.50001", 4189.5) == 1.0  # within rel_tol 1e-4
    assert numeric_match("4190", 4189.5) == 0.0
    assert numeric_match("0.0000001", 0.0) == 1.0 and numeric_match("0.001", 0.0) == 0.0
    assert numeric_match("about 10", 10.4, rel_tol=0.05) == 1.0 and numeric_match("nothing", 1.0) == 0.0


def test_unit_tests_passed():
    assert unit_tests_passed(3, 4) == 0.75 and unit_tests_passed(0, 2) == 0.0
    with pytest.raises(ValueError, match="total=0"):
        unit_tests_passed(0, 0)
    with pytest.raises(ValueError, match="passed=5"):
        unit_tests_passed(5, 4)


def test_format_penalty_is_capped_and_non_positive():
    assert format_penalty(0, per_turn=0.1) == 0.0
    assert format_penalty(3, per_turn=0.1) == pytest.approx(-0.3)
    assert format_penalty(50, per_turn=0.1, cap=0.5) == -0.5
    with pytest.raises(ValueError, match="-0.1"):
        format_penalty(1, per_turn=-0.1)


def test_weighted_total_of_named_components():
    components = {"correct": 1.0, "tests_passed": 0.5, "format": -0.2}
    assert weighted_total(components, {"correct": 1.0, "tests_passed": 0.0, "format": 1.0}) == pytest.approx(0.8)
    assert weighted_total(components, {"correct": 0.5, "tests_passed": 1.0, "format": 0.5}) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="tests_passed"):
        weighted_total(components, {"correct": 1.0, "format": 1.0})


def test_reward_result_scored_and_failed():
    scored = RewardResult.scored({"correct": 1.0}, {"correct": 2.0})
    assert scored.status == "scored" and scored.total == 2.0 and scored.failure is None
    failed = RewardResult.failed("sandbox", "could not start")
    assert failed.status == FAILED and failed.failure == {"boundary": "sandbox", "message": "could not start"}
    with pytest.raises(ValueError, match="'model'"):
        RewardResult.failed("model", "not an infrastructure boundary")


def test_failed_episodes_are_excluded_from_advantages_not_scored_zero():
    rewards = [1.0, 0.0, 0.0, 1.0]
    statuses = ["completed", "completed", FAILED, "truncated"]
    advantages = group_advantages(rewards, statuses)
    mean = 2.0 / 3.0  # over the three non-failed episodes only
    assert advantages[2] is None
    assert advantages[0] == pytest.approx(1 - mean) and advantages[1] == pytest.approx(-mean)
    # Scoring the failure as 0 instead would have moved the baseline:
    assert group_advantages(rewards, ["completed"] * 4)[0] == pytest.approx(0.5)


def test_group_advantages_edge_cases():
    assert group_advantages([1.0, 0.0], [FAILED, FAILED]) == [None, None]
    assert group_advantages([0.7], ["completed"]) == [0.0]
    normalized = group_advantages([1.0, 0.0], ["completed", "completed"], normalize_std=True, eps=0.0)
    assert normalized == [1.0, -1.0]
    assert all(math.isfinite(a) for a in group_advantages([1.0, 1.0], ["completed"] * 2, normalize_std=True))
    with pytest.raises(ValueError, match="2 rewards but 1 statuses"):
        group_advantages([1.0, 0.0], ["completed"])


def test_drop_uniform_groups_keeps_only_groups_with_a_reward_spread():
    from agentrl.reward import drop_uniform_groups
    from agentrl.types import Status, Trajectory

    def traj(group: str, reward: float, status: Status = Status.COMPLETED) -> Trajectory:
        t = Trajectory(trajectory_id=f"{group}-{reward}-{status.value}", task_id=group, group_id=group,
                       env_id="toy", reward=reward)
        t.status = status
        return t

    spread = [traj("a", 0.0), traj("a", 1.0)]
    all_zero = [traj("b", 0.0), traj("b", 0.0)]
    # a failed member's reward does not count: the scored members agree, so no advantage is non-zero
    failed_differs = [traj("c", 1.0), traj("c", 0.0, Status.FAILED)]
    truncated_differs = [traj("d", 0.0, Status.TRUNCATED), traj("d", 0.5)]
    kept, dropped = drop_uniform_groups(spread + all_zero + failed_differs + truncated_differs)
    assert kept == spread + truncated_differs
    assert dropped == 2
    assert drop_uniform_groups([]) == ([], 0)
