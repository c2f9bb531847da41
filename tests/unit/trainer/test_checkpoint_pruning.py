"""Old training checkpoints are deleted after each save; the newest ones, and the one `latest` names, stay."""

import os

from agentrl.trainer.policy_trainer import prune_checkpoints


def test_prune_keeps_the_newest_and_the_latest(tmp_path):
    for step in (3, 10, 4, 11):  # step10 > step4: the order is numeric, not by name
        os.makedirs(tmp_path / f"step{step}")
    (tmp_path / "zero_to_fp32.py").write_text("")  # DeepSpeed's helper scripts are not checkpoints
    (tmp_path / "latest").write_text("step11")
    deleted = prune_checkpoints(str(tmp_path), keep=2)
    assert sorted(os.path.basename(d) for d in deleted) == ["step3", "step4"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step10", "step11", "zero_to_fp32.py"]
    (tmp_path / "latest").write_text("step10")  # latest is never deleted, even when it is not among the newest
    os.makedirs(tmp_path / "step12")
    os.makedirs(tmp_path / "step13")
    prune_checkpoints(str(tmp_path), keep=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step10", "step13", "zero_to_fp32.py"]
