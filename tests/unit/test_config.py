"""Job configs: YAML deltas over typed defaults, overrides, and errors that name the key before anything starts."""

import warnings

import pytest

from agentrl.config import ConfigError, JobConfig, load_config


def test_quickstart_config_loads_with_overrides_and_ties_the_trainer_to_the_job():
    job, resolved = load_config("configs/quickstart.yaml", ["rollout.group_size=4", "run_dir=/tmp/x",
                                                            "rollout.temperature=0.7"])
    assert isinstance(job, JobConfig) and job.rollout.group_size == 4
    assert job.trainer.run_dir == "/tmp/x" and job.trainer.temperature == 0.7
    assert job.env.train_tasks == job.env.num_tasks - job.env.eval_tasks
    assert resolved.rollout.group_size == 4


@pytest.mark.parametrize("override,key", [
    ("rollout.nope=1", "rollout.nope"),
    ("rollout.group_size=abc", "rollout.group_size"),
    ("rollout.group_size=0", "rollout.group_size"),
    ("algorithm.mode=fast", "algorithm.mode"),
    ("trainer.zero_stage=1", "zero_stage"),
    ("env.eval_tasks=5000", "env.eval_tasks"),
    ("model.preset=gpt5", "model.preset"),
    ("cluster.placement=anywhere", "cluster.placement"),
    ("algorithm.sft_lr=0", "algorithm.sft_lr"),
    ("algorithm.sft_target_success=1.5", "algorithm.sft_target_success"),
    ("algorithm.sft_eval_every=0", "algorithm.sft_eval_every"),
    ("algorithm.sft_check_every_step_from=1.2", "algorithm.sft_check_every_step_from"),
])
def test_bad_configs_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/quickstart.yaml", [override])


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["oops"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/does-not-exist.yaml")


def test_context_schedule_picks_the_stage_in_force():
    job, _ = load_config(None, ["algorithm.context_schedule=[{start_step: 0, max_trajectory_tokens: 8192},"
                                "{start_step: 10, max_trajectory_tokens: 65536}]"])
    assert job.algorithm.max_trajectory_tokens(0, 1024) == 8192
    assert job.algorithm.max_trajectory_tokens(9, 1024) == 8192
    assert job.algorithm.max_trajectory_tokens(10, 1024) == 65536
    with pytest.raises(ConfigError, match="increase"):
        load_config(None, ["algorithm.context_schedule=[{start_step: 5, max_trajectory_tokens: 1},"
                           "{start_step: 1, max_trajectory_tokens: 2}]"])


def test_a_batch_trains_only_on_groups_with_a_reward_spread(tmp_path):
    from agentrl.reward import select_trainable
    from agentrl.store import StoreConfig, TrajectoryStore
    from agentrl.types import Status, Trajectory

    def traj(group: str, reward: float, i: int = 0) -> Trajectory:
        t = Trajectory(trajectory_id=f"{group}{reward}{i}", task_id=group, group_id=group, env_id="toy",
                       reward=reward)
        t.append_sampled([1], [0.0], 0)
        return t

    batch = [traj("a", 0.0), traj("a", 1.0), traj("b", 0.0), traj("b", 0.0, 1)]
    job, _ = load_config("configs/quickstart.yaml")
    assert job.algorithm.skip_uniform_groups and job.algorithm.failed_members == "resample"
    assert select_trainable(batch, 2, skip_uniform_groups=True, drop_short_groups=False) == (batch[:2], 1, 0)
    assert select_trainable(batch, 2, skip_uniform_groups=False, drop_short_groups=False) == (batch, 0, 0)
    # group c lost a member (the batch holds the members that did not fail): kept, or dropped by failed_members=drop
    short = batch + [traj("c", 1.0)]
    for drop, kept in ((False, short), (True, batch)):
        assert select_trainable(short, 2, skip_uniform_groups=False, drop_short_groups=drop) == (kept, 0, int(drop))
    # the store applies the rule to the batch it hands out: the driver gets the Selection, the ranks the members
    store = TrajectoryStore(StoreConfig(run_dir=str(tmp_path), group_size=2))
    failed = traj("c", 0.0, 1)
    failed.status = Status.FAILED
    store.put(short + [failed])
    selected, members = store.take_training_batch(3, 0, 0, skip_uniform_groups=True, drop_short_groups=True)
    assert (selected.taken, selected.group_ids, selected.trajectories, selected.uniform, selected.short) == \
        (True, ["a"], 2, 1, 1)
    assert members == batch[:2]
    selected, members = store.take_training_batch(1, 0, 0)
    assert not selected.taken and members == []
    with pytest.raises(ConfigError, match="failed_members"):
        load_config("configs/quickstart.yaml", ["algorithm.failed_members=retry"])


def test_env_settings_are_checked_against_the_env_before_any_actor_starts():
    from agentrl.config import check_env

    check_env(load_config("configs/quickstart.yaml")[0])
    with pytest.raises(ConfigError, match=r"env\.num_tasks=20000 but agentrl/Calc-v0 holds 1000 tasks"):
        check_env(load_config("configs/quickstart.yaml", ["env.num_tasks=20000"])[0])
    check_env(load_config("configs/quickstart.yaml", ["env.num_tasks=2000", "env.kwargs.num_tasks=2000"])[0])
    with pytest.raises(ConfigError, match=r"env\.kwargs=.*max_operand=1 must be an integer >= 2"):
        check_env(load_config("configs/quickstart.yaml", ["env.kwargs.max_operand=1"])[0])
    with pytest.raises(ConfigError, match=r"env\.id='agentrl/Nope-v0'.*no environment registered"):
        check_env(load_config("configs/quickstart.yaml", ["env.id=agentrl/Nope-v0"])[0])


def test_an_override_replaces_a_value_and_env_kwargs_belong_to_their_env():
    job, _ = load_config("configs/quickstart.yaml", ["env.kwargs={}"])
    assert job.env.kwargs == {}  # emptied (a merge would have kept the file's Calc kwargs)
    job, _ = load_config("configs/quickstart.yaml", ["env.id=agentrl/KVChain-v0"])
    assert job.env.kwargs == {}  # Calc's kinds/max_operand would make KVChain's constructor fail
    job, _ = load_config("configs/quickstart.yaml", ["env.id=agentrl/KVChain-v0", "env.kwargs.hops=3"])
    assert job.env.kwargs == {"hops": 3}
    job, _ = load_config("configs/quickstart.yaml", ["env.kwargs.max_turns=5"])
    assert job.env.kwargs == {"max_turns": 5, "kinds": [0, 3], "max_operand": 9}
    job, _ = load_config("configs/quickstart.yaml", ["env.id=agentrl/Calc-v0"])  # the same env: its kwargs stay
    assert job.env.kwargs["kinds"] == [0, 3]


def test_zero3_on_one_trainer_rank_warns_and_more_ranks_do_not():
    with pytest.warns(UserWarning, match="trainer.zero_stage=3 with cluster.trainer_ranks=1"):
        job, _ = load_config("configs/quickstart.yaml", ["trainer.zero_stage=3"])
    assert job.trainer.zero_stage == 3  # a warning: the user's choice stands
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("configs/quickstart.yaml", ["trainer.zero_stage=3", "cluster.trainer_ranks=2"])
        load_config("configs/quickstart.yaml", ["trainer.zero_stage=2"])
