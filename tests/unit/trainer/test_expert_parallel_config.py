"""The expert_parallel setting: default 1, and ZeRO-3 with expert parallelism refused before anything starts."""

import pytest

from agentrl.config import ConfigError, load_config
from agentrl.trainer import TrainerConfig


def test_expert_parallel_defaults_to_one_and_is_validated():
    assert TrainerConfig(run_dir="r").expert_parallel == 1
    assert TrainerConfig(run_dir="r", zero_stage=2, expert_parallel=8).expert_parallel == 8
    with pytest.raises(ValueError, match="expert_parallel must be >= 1"):
        TrainerConfig(run_dir="r", expert_parallel=0)


def test_zero3_with_expert_parallelism_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="expert_parallel=2 needs zero_stage=2"):
        load_config("configs/quickstart.yaml", ["trainer.zero_stage=3", "trainer.expert_parallel=2"])


def test_expert_parallel_must_divide_the_trainer_ranks():
    with pytest.raises(ConfigError, match=r"trainer\.expert_parallel=2 must divide cluster\.trainer_ranks=3"):
        load_config("configs/quickstart.yaml", ["trainer.expert_parallel=2", "cluster.trainer_ranks=3"])
    job, _ = load_config("configs/quickstart.yaml", ["trainer.expert_parallel=2", "cluster.trainer_ranks=4"])
    assert job.trainer.expert_parallel == 2


def test_a_checkpoint_tells_its_expert_parallel_degree(tmp_path):
    from agentrl.trainer.expert_checkpoint import MODEL_DIR, saved_expert_parallel

    assert saved_expert_parallel(str(tmp_path)) == 1  # no model shards: saved without expert parallelism
    (tmp_path / MODEL_DIR).mkdir()
    for name in ("model-dense.safetensors", "model-experts-00001-of-00004.safetensors",
                 "model-experts-00002-of-00004.safetensors"):
        (tmp_path / MODEL_DIR / name).touch()
    assert saved_expert_parallel(str(tmp_path)) == 4
