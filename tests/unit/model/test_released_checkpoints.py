"""Released checkpoints of the family: the Kimi Linear config as published (shrunk) builds transformers' own
KimiLinearForCausalLM tensor for tensor and logit for logit; a Kimi K3 directory (nested config, language_model.
names, a vision tower beside it, MXFP4 experts) loads into agentrl's model; strict loading names what does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from agentrl.model import released
from agentrl.model.checkpoint import load_checkpoint_tensors, save_state_dict, to_checkpoint_tensors
from agentrl.model.config import HybridMoEConfig, preset_config
from agentrl.model.modeling import HybridMoEForCausalLM
from tests.k3_layout import E2M1, k3_directory, quantize_mxfp4

RELEASED = Path(__file__).resolve().parents[2] / "fixtures" / "kimi-linear-48b-a3b-instruct.config.json"
SHRUNK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, pad_token_id=511, bos_token_id=0,
              eos_token_id=1, linear_attn_config={"full_attn_layers": [4], "head_dim": 16, "kda_layers": [1, 2, 3],
                                                  "num_heads": 2, "short_conv_kernel_size": 4})


def released_dir(tmp_path) -> Path:
    """The released config.json with its sizes shrunk and nothing else changed (no key added or removed)."""
    config = json.loads(RELEASED.read_text())
    assert set(SHRUNK) <= set(config)
    config.update(SHRUNK)
    path = tmp_path / "released"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_released_config_builds_kimi_linear_not_agentrls_presets(tmp_path):
    config = HybridMoEConfig.from_pretrained(str(released_dir(tmp_path)))
    assert config.mla_use_output_gate is False and config.attn_res_block_size is None
    assert config.gate_lower_bound is None and config.use_full_rank_gate is False  # unbounded, low-rank gate
    assert config.moe_balancing == "none"  # the released router bias is kept
    assert config.head_dim == 16 + 8  # derived; the released file's 72 is ignored


def checkpoint_shapes(tensors) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in tensors}


def test_tensor_names_and_shapes_equal_transformers_kimi_linear(tmp_path):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    path = released_dir(tmp_path)
    with torch.device("meta"):
        ours = HybridMoEForCausalLM(HybridMoEConfig.from_pretrained(str(path)))
    theirs = KimiLinearForCausalLM(KimiLinearConfig.from_pretrained(str(path)))
    theirs.save_pretrained(str(tmp_path / "theirs"))  # transformers writes checkpoint names (its own are fused)
    with safe_open(str(tmp_path / "theirs" / "model.safetensors"), "pt") as f:
        # transformers renames block_sparse_moe -> mlp on load and undoes it on save for every layer, so it writes
        # the dense first layer's MLP under block_sparse_moe; the released checkpoint and vLLM's loader call it mlp
        # (and transformers loads either name)
        expected = {name.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): tuple(f.get_slice(name).get_shape())
                    for name in f.keys()}
    assert checkpoint_shapes(to_checkpoint_tensors(ours.state_dict())) == expected


def test_logits_equal_transformers_on_the_same_weights(tmp_path):
    from transformers import KimiLinearForCausalLM

    path = released_dir(tmp_path)
    config = HybridMoEConfig.from_pretrained(str(path))
    torch.manual_seed(0)
    ours = HybridMoEForCausalLM(config).float().eval()
    with torch.no_grad():
        for moe in ours.moe_layers:  # a non-trivial selection bias must select but not weight
            moe.gate.e_score_correction_bias.normal_(0, 0.05)
    save_state_dict(ours.state_dict(), config, str(tmp_path / "ours"))
    (path / "model.safetensors").write_bytes((tmp_path / "ours" / "model.safetensors").read_bytes())
    theirs, info = KimiLinearForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(0, config.vocab_size, (2, 45))
    with torch.no_grad():
        a, b = ours(ids).logits, theirs.eval()(ids).logits
    # transformers fixes its MLA norms' eps at 1e-6 where the config (and vLLM) says rms_norm_eps = 1e-5
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert a.abs().max() > 0.1


# ---- MXFP4 ------------------------------------------------------------------------------------------------------
def naive_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    flat_p, flat_s = packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1])
    out = torch.empty(flat_p.shape[0], flat_p.shape[1] * 2)
    for r in range(flat_p.shape[0]):
        for j in range(flat_p.shape[1] * 2):
            code = int(flat_p[r, j // 2]) >> (4 * (j % 2)) & 0xF
            value = E2M1[code & 7] * (-1 if code & 8 else 1)
            out[r, j] = value * 2.0 ** (int(flat_s[r, j // 32]) - 127)
    return out.reshape(*packed.shape[:-1], -1)


def test_mxfp4_dequantization_matches_the_naive_reading_and_vllms():
    torch.manual_seed(0)
    w = torch.randn(3, 5, 64) * torch.logspace(-3, 2, 5)[None, :, None]
    packed, scale = quantize_mxfp4(w)
    ours = released.dequantize_mxfp4(packed, scale)
    torch.testing.assert_close(ours, naive_dequantize(packed, scale), atol=0, rtol=0)
    assert ((ours - w).abs() <= w.abs().reshape(3, 5, 2, 32).amax(-1).repeat_interleave(32, -1) / 4 + 1e-9).all()
    mxfp4 = pytest.importorskip("vllm.model_executor.layers.fused_moe.flashinfer_moe_ep")
    theirs = mxfp4._dequant_mxfp4_ue8m0_gran32(packed[0], scale[0])  # bf16, as vLLM's EP path builds it
    torch.testing.assert_close(ours[0].to(torch.bfloat16), theirs, atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not cover"):
        released.dequantize_mxfp4(packed, scale[..., :1])


# ---- a Kimi K3 directory ------------------------------------------------------------------------------------------
def test_a_k3_directory_loads_dequantized(tmp_path):
    torch.manual_seed(0)
    model = HybridMoEForCausalLM(preset_config("tiny")).float()
    path = k3_directory(tmp_path, model)
    loaded = HybridMoEForCausalLM.from_pretrained(str(path))
    assert loaded.config.to_dict() == {**model.config.to_dict(), "transformers_version": loaded.config.transformers_version}
    for name, expected in model.state_dict().items():
        got = loaded.state_dict()[name]
        if "experts.w" in name:  # dequantized: the reference decoder's values exactly
            packed, scale = quantize_mxfp4(expected)
            torch.testing.assert_close(got, naive_dequantize(packed, scale), atol=0, rtol=0)
        else:
            assert torch.equal(got, expected), name
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    assert torch.isfinite(loaded(ids).logits).all()


def test_other_quantizations_are_refused_naming_them(tmp_path):
    model = HybridMoEForCausalLM(preset_config("tiny"))
    path = k3_directory(tmp_path, model)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        HybridMoEForCausalLM.from_pretrained(str(path))


def test_strict_loading_names_every_misfit(tmp_path):
    model = HybridMoEForCausalLM(preset_config("tiny"))
    model.save_pretrained(str(tmp_path))
    tensors = load_checkpoint_tensors(str(tmp_path))
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    tensors["model.layers.1.self_attn.stray.weight"] = torch.zeros(2)
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as error:
        HybridMoEForCausalLM.from_pretrained(str(tmp_path))
    message = str(error.value)
    assert "1 missing: model.layers.1.self_attn.o_proj.weight" in message
    assert "1 unexpected: model.layers.1.self_attn.stray.weight" in message
    assert f"lm_head.weight (3, 3) (model: ({model.config.vocab_size}, {model.config.hidden_size}))" in message
