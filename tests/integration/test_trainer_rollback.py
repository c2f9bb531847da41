"""PolicyTrainer.roll_back: the driver's undo of an update that stalled a run (agentrl/stall.py) restores the weights
and the optimizer state of the checkpoint before that update, as the next policy version."""

import pytest

from agentrl.trainer import LossConfig, create_trainer_group
from tests.integration.test_trainer import config, make_groups, model_dir, on_all  # noqa: F401


def test_roll_back_restores_the_checkpoint_before_the_last_update_as_a_new_version(ray_session, model_dir, tmp_path):
    cfg = config(tmp_path / "run", zero_stage=2, lr=1e-3, loss=LossConfig(kind="ppo"))
    first, second = make_groups(0, 2, seed=3), make_groups(2, 2, seed=4)
    group = create_trainer_group(cfg, model_dir, num_ranks=1)
    try:
        with pytest.raises(Exception, match="no checkpoint .* to roll back to"):
            on_all(group, "roll_back")
        on_all(group, "step", first)
        on_all(group, "save_checkpoint", {"rl_step": 1})
        before = on_all(group, "replica_checksum")[0]
        on_all(group, "step", second)  # the update to undo
        on_all(group, "save_checkpoint", {"rl_step": 2})
        after = on_all(group, "replica_checksum")[0]
        assert after != before

        state = on_all(group, "roll_back")[0]
        assert state["rl_step"] == 1 and state["global_step"] == 1
        assert on_all(group, "replica_checksum")[0] == before
        info = on_all(group, "info")[0]
        assert info["version"] == 3 and info["step"] == 2  # engines take the restored weights as a new version
        # Adam's moments and step count came back too: the same update from there lands on the same weights
        on_all(group, "step", second)
        assert on_all(group, "replica_checksum")[0] == after
    finally:
        group.shutdown()
