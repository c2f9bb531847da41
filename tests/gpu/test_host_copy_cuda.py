"""to_host on CUDA: bucketed device→host copies equal the tensors, own their storage, and keep the input's order."""

import pytest
import torch

from agentrl.trainer.host_copy import to_host

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 30])  # a bucket per tensor, a few, one per dtype
def test_device_tensors_come_back_equal_and_independent(bucket_bytes):
    g = torch.Generator(device="cuda").manual_seed(0)
    src = {"w": torch.randn(7, 3, device="cuda", generator=g).to(torch.bfloat16),
           "cpu": torch.arange(4.0),
           "b": torch.randn(11, device="cuda", generator=g),
           "t": torch.randn(4, 6, device="cuda", generator=g).to(torch.bfloat16).t(),  # not contiguous
           "i": torch.arange(9, device="cuda").view(3, 3)}
    out = to_host(src, bucket_bytes=bucket_bytes)
    assert list(out) == list(src)
    storages = set()
    for k, t in src.items():
        assert out[k].device.type == "cpu" and out[k].dtype == t.dtype and out[k].shape == t.shape
        assert torch.equal(out[k], t.cpu())
        storages.add(out[k].untyped_storage().data_ptr())
    assert len(storages) == len(src)  # safetensors refuses tensors that share storage
