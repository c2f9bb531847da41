"""A Kimi K3 release's directory layout, written from agentrl's model (no K3 checkpoint can be had here): nested
config, language_model. names, a vision tower and an MTP layer beside the language model, MXFP4 routed experts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from agentrl.model.checkpoint import to_checkpoint_tensors
from agentrl.model.modeling import HybridMoEForCausalLM

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference encoder: per 32 inputs an exponent e = ceil(log2(max|w| / 6)), each value the nearest E2M1 code
    of w / 2^e, packed two per byte, low nibble first."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1)
    codes = (scaled.abs()[..., None] - table).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.reshape(*w.shape).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)



def k3_directory(tmp_path: Path, model: HybridMoEForCausalLM, name: str = "k3") -> Path:
    """agentrl's model written as a K3 release is laid out: nested config, language_model. names, a vision tower,
    an MTP layer, and routed experts in MXFP4 (compressed-tensors)."""
    path = tmp_path / name
    path.mkdir()
    text = model.config.to_dict()
    quantization = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"]}}}
    config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
              "text_config": {**text, "quantization_config": quantization}, "vision_config": {"patch_size": 14}}
    (path / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, t in to_checkpoint_tensors(model.state_dict()):
        name = "language_model." + (name[len("model."):] if name.startswith("model.layers.") else name)
        if ".experts." in name:
            tensors[name + "_packed"], tensors[name + "_scale"] = quantize_mxfp4(t.float())
        else:
            tensors[name] = t.contiguous()
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(4, 4)
    tensors[f"language_model.layers.{model.config.num_hidden_layers}.eh_proj.weight"] = torch.zeros(2, 2)  # MTP
    half = sorted(tensors)[: len(tensors) // 2]  # two shards: a packed weight and its scale may sit apart
    save_file({k: tensors[k] for k in half}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in half}, str(path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {k: ("model-00001-of-00002.safetensors" if k in half else
                                "model-00002-of-00002.safetensors") for k in tensors}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path
