"""to_host: host copies of a state dict, bucketed on devices; on CPU plain clones."""

import pytest
import torch

from agentrl.trainer.host_copy import _buckets, to_host


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "c": torch.randn(2, 3, 2, generator=g).transpose(0, 2), "d": torch.arange(7)}


def test_cpu_tensors_are_cloned_in_order_with_their_values():
    src = state()
    out = to_host(src)
    assert list(out) == list(src)
    for k in src:
        assert out[k].dtype == src[k].dtype and out[k].shape == src[k].shape and out[k].is_contiguous()
        assert torch.equal(out[k], src[k])
        assert out[k].untyped_storage().data_ptr() != src[k].untyped_storage().data_ptr()
    src["a"].add_(1.0)
    assert not torch.equal(out["a"], src["a"])  # a copy, not a view


def test_buckets_never_exceed_the_budget_unless_one_tensor_does():
    tensors = {"x": torch.zeros(10), "y": torch.zeros(30), "z": torch.zeros(5), "w": torch.zeros(100)}
    assert _buckets(list(tensors), tensors, 4 * 40) == [["x", "y"], ["z"], ["w"]]
    assert _buckets(list(tensors), tensors, 1 << 20) == [["x", "y", "z", "w"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        to_host(tensors, bucket_bytes=0)
