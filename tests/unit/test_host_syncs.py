"""Naming who made the host wait (agentrl/host_syncs.py; the syncs themselves need CUDA:
tests/gpu/test_model_cuda.py)."""

import torch.nn.functional as F

from agentrl.host_syncs import SyncSite, source_path
from agentrl.model import kda
from agentrl.trainer import batching


def test_source_paths_name_files_as_they_are_imported():
    assert source_path(kda.__file__) == "agentrl/model/kda.py"
    # the checkout maps trainer/ into the package; an installed wheel has it under agentrl/
    assert source_path(batching.__file__) in ("trainer/batching.py", "agentrl/trainer/batching.py")
    assert source_path(F.__file__) == "torch/nn/functional.py"


def test_a_site_is_ours_when_agentrl_made_the_call():
    assert SyncSite(f"{source_path(batching.__file__)}:63 forward_args", "").ours
    assert SyncSite("agentrl/model/balancing.py:139 observe", "").ours
    assert not SyncSite("fla/ops/utils/index.py:128 _segmented_arange", "agentrl/model/kda_ops.py:601 kda").ours
    assert not SyncSite("deepspeed/runtime/utils.py:233 is_invalid_grad_norm", "").ours
