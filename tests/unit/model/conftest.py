import pytest
import torch

from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM


@pytest.fixture(autouse=True)
def _torch_settings():
    torch.set_num_threads(2)
    torch.manual_seed(0)


def tiny_model(**overrides) -> HybridMoEForCausalLM:
    torch.manual_seed(0)
    return HybridMoEForCausalLM(preset_config("tiny", **overrides)).float()
