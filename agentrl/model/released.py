"""Released checkpoints of the family read into agentrl's layout: Kimi K3's multimodal directory, MXFP4 experts.

A Kimi Linear directory (model_type `kimi_linear`) is agentrl's own layout already: its config's missing keys take
the family's defaults in `HybridMoEConfig` (vLLM's `KimiLinearConfig` defaults: no MLA output gate, the unbounded
gate, the low-rank output gate, no AttnRes, no load balancing), and its tensors load by name. A Kimi K3 directory
differs in three ways, all undone here on load:

* config.json is `KimiK3Config`: the language model's keys sit in `text_config` beside a `vision_config`
  (`flatten_config`);
* tensor names carry the multimodal wrapper's `language_model.` prefix (its decoder layers directly under it), and
  the vision tower and projector sit beside it; agentrl trains the language model only, so those, and multi-token
  prediction layers beyond `num_hidden_layers`, are skipped (`normalize_names`);
* routed experts may be MXFP4 (compressed-tensors `mxfp4-pack-quantized`: `weight_packed` uint8 holding two E2M1
  values per byte, low nibble first, and `weight_scale` E8M0 exponents per 32 input channels), dequantized here
  to fp32 (`dequantize_mxfp4`). Any other quantization is refused, naming it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

MXFP4_GROUP = 32
# E2M1 values by code: sign bit 3, exponent bits 2-1, mantissa bit 0
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
SUPPORTED_QUANTIZATION = "compressed-tensors mxfp4-pack-quantized (routed experts)"


def is_k3_config(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "kimi_k3" or isinstance(config.get("text_config"), dict)


def flatten_config(config: dict[str, Any]) -> dict[str, Any]:
    """A K3 config.json's language-model keys as one flat Kimi Linear config (the quantization checked and
    dropped: agentrl holds the weights dequantized)."""
    text = dict(config.get("text_config") or {})
    quantization = text.pop("quantization_config", None) or config.get("quantization_config")
    check_quantization(quantization)
    text["model_type"] = "kimi_linear"
    text["architectures"] = ["KimiLinearForCausalLM"]
    return text


def check_quantization(quantization: dict[str, Any] | None) -> None:
    """ValueError unless `quantization` is absent or MXFP4 routed experts (what `dequantize_mxfp4` reads)."""
    if not quantization:
        return
    method = quantization.get("quant_method")
    formats = {group.get("format", quantization.get("format"))
               for group in (quantization.get("config_groups") or {}).values()} or {quantization.get("format")}
    if method != "compressed-tensors" or formats - {"mxfp4-pack-quantized"}:
        raise ValueError(f"checkpoint quantization quant_method={method!r} format={sorted(map(str, formats))} is not "
                         f"supported; agentrl dequantizes {SUPPORTED_QUANTIZATION} on load and reads unquantized "
                         "bf16/fp32 weights otherwise")


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K/2] uint8 E2M1 pairs (low nibble first) and [..., N, K/32] E8M0 exponents → [..., N, K] values."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight_packed must be uint8, got {packed.dtype}")
    exponents = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    if exponents.shape[-1] * MXFP4_GROUP != packed.shape[-1] * 2 or exponents.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"MXFP4 scales {tuple(scale.shape)} do not cover weights {tuple(packed.shape)} in groups of "
                         f"{MXFP4_GROUP}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    values = _E2M1.to(packed.device)[codes]
    factors = torch.exp2(exponents.float() - 127.0).repeat_interleave(MXFP4_GROUP, dim=-1)
    return (values * factors).to(dtype)


def normalize_names(tensors: Iterable[tuple[str, torch.Tensor]], num_hidden_layers: int
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """K3 checkpoint (name, tensor) pairs → agentrl's names, MXFP4 pairs dequantized, other towers skipped.

    A `weight_packed` waits for its `weight_scale` (they may come in either order, from different shards)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    skipped = 0
    for name, tensor in tensors:
        if name.startswith(_SKIPPED_PREFIXES):
            skipped += 1
            continue
        if name.startswith("language_model."):
            name = name[len("language_model."):]
            if name.startswith(("layers.", "embed_tokens.", "norm.")):
                name = "model." + name
            elif not name.startswith(("model.", "lm_head.")):
                name = "model." + name
        if (m := _LAYER.match(name)) and int(m[1]) >= num_hidden_layers:
            skipped += 1  # multi-token prediction layers: not part of the trained model
            continue
        for suffix in ("weight_packed", "weight_scale"):
            if name.endswith("." + suffix):
                stem = name[: -len(suffix)]
                parts = pending.setdefault(stem, {})
                parts[suffix] = tensor
                if len(parts) == 2:
                    del pending[stem]
                    yield stem + "weight", dequantize_mxfp4(parts["weight_packed"], parts["weight_scale"])
                break
        else:
            if name.endswith(".weight_global_scale") or name.endswith(".input_global_scale"):
                raise ValueError(f"{name}: a global scale means NVFP4, not MXFP4; only {SUPPORTED_QUANTIZATION} is "
                                 "supported")
            yield name, tensor
    if pending:
        raise ValueError(f"MXFP4 tensors without their other half: {sorted(pending)[:4]}")
    if skipped:
        log.info("skipped %d tensors outside the language model (vision tower, projector, MTP layers)", skipped)
