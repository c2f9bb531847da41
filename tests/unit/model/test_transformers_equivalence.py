"""With the K3-only features off, the model is Kimi Linear: it reproduces transformers' KimiLinearForCausalLM on the
same checkpoint (fp32), and transformers loads agentrl's checkpoint files with nothing missing."""

import torch
from transformers import KimiLinearForCausalLM

from tests.unit.model.conftest import tiny_model

# transformers' port fixes the MLA norms' eps at 1e-6 and uses rms_norm_eps in KDA's output norm; vLLM uses
# rms_norm_eps and 1e-5. Aligning all three at 1e-6 makes the two codes compute the same function.
KIMI_LINEAR = dict(attn_res_block_size=None, mla_use_output_gate=False, routed_scaling_factor=2.0,
                   rms_norm_eps=1e-6, kda_output_norm_eps=1e-6, num_expert_group=2, topk_group=2,
                   linear_attn_config=dict(gate_lower_bound=None, use_full_rank_gate=False))


def test_logits_match_transformers_kimi_linear(tmp_path):
    model = tiny_model(**KIMI_LINEAR).eval()
    with torch.no_grad():
        for moe in model.moe_layers:  # a non-trivial selection bias must select but not weight
            moe.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(str(tmp_path))
    reference, info = KimiLinearForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                            output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 45))
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    assert ours.abs().max() > 0.1  # not a vacuous comparison of near-zero logits
