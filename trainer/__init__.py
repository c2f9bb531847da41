"""The DeepSpeed policy optimizer (imported as ``agentrl.trainer``).

- `PolicyTrainer` (policy_trainer.py): one DeepSpeed rank; step / publish_weights / save_checkpoint / load_checkpoint.
- `create_trainer_group` (actor.py): the ranks as Ray actors.
- `TrainerConfig` (config.py), `LossConfig` and the losses (losses.py), packing (batching.py), weights (publish.py).
- Expert parallelism (`TrainerConfig.expert_parallel`): the layer in agentrl/model/expert_parallel.py, DeepSpeed's
  MoE groups in zero.py, checkpoints in the non-EP layout in expert_checkpoint.py.

Importing the package loads neither DeepSpeed nor Ray; `PolicyTrainer` and `create_trainer_group` load them on first
access.
"""

from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.losses import LossConfig
from agentrl.trainer.publish import PublishedWeights, latest_weights

__all__ = ["LossConfig", "PolicyTrainer", "PublishedWeights", "TrainerConfig", "TrainerGroup",
           "create_trainer_group", "latest_weights"]


def __getattr__(name: str):
    if name == "PolicyTrainer":
        from agentrl.trainer.policy_trainer import PolicyTrainer

        return PolicyTrainer
    if name in ("create_trainer_group", "TrainerGroup"):
        from agentrl.trainer import actor

        return getattr(actor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
