"""Context parallelism's MLA attention on CUDA: flash varlen with the keys' own offsets puts each query piece at the
end of its keys (bottom-right causal), as the CPU path (zero-padded queries, causal SDPA) does."""

import pytest
import torch

from agentrl.model.context_parallel import prefix_causal_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run through the device tool)")


def test_flash_prefix_attention_matches_the_reference_path():
    g = torch.Generator(device="cuda").manual_seed(0)
    keys, queries = [300, 1024, 77], [120, 1024, 1]  # per sequence: its keys, and its last rows as queries
    q = torch.randn(sum(queries), 4, 192, device="cuda", generator=g)
    k = torch.randn(sum(keys), 4, 192, device="cuda", generator=g)
    v = torch.randn(sum(keys), 4, 128, device="cuda", generator=g)
    cu_q = torch.tensor([0, 120, 1144, 1145], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 300, 1324, 1401], dtype=torch.int32, device="cuda")
    flash = prefix_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 0.07)
    reference = prefix_causal_attention(q, k, v, cu_q, cu_k, 0.07)  # fp32: the padded-query SDPA path
    torch.testing.assert_close(flash.float(), reference, rtol=2e-2, atol=2e-2)
