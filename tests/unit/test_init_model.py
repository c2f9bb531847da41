"""Policy directories: fresh presets with a tokenizer in each chat format's layout, and checkpoints brought in (a K3
directory rewritten in agentrl's layout; training-knob overrides beside the original weights)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from agentrl.chat import load_chat_format, load_tokenizer
from agentrl.config import ConfigError, load_config
from agentrl.init_model import import_checkpoint, init_model, needs_import
from agentrl.model.config import HybridMoEConfig
from agentrl.model.modeling import HybridMoEForCausalLM
from tests.k3_layout import k3_directory


@pytest.mark.parametrize("preset, chat_format", [("tiny", "agentrl"), ("kimi-linear-tiny", "kimi"),
                                                 ("tiny", "kimi_k3"), ("tiny", "qwen3")])
def test_a_fresh_policy_is_a_complete_checkpoint_in_its_format(tmp_path, preset, chat_format):
    path = init_model(str(tmp_path / "p"), preset=preset, chat_format=chat_format, vocab_size=1024,
                      env_ids=("agentrl/Calc-v0",))
    chat = load_chat_format(path)
    assert chat.name == chat_format
    config = HybridMoEConfig.from_pretrained(path)
    generation = json.load(open(os.path.join(path, "generation_config.json")))
    assert list(chat.stop_ids) == generation["eos_token_id"] and config.eos_token_id == chat.stop_ids[0]
    # every id the format writes fits the embedding (Kimi's two spare reserved ids lie past it, never written)
    written = {chat.tokenizer.token_id(m) for m in chat.markers} | {config.pad_token_id, config.bos_token_id}
    assert max(written) < config.vocab_size <= chat.tokenizer.vocab_size
    HybridMoEForCausalLM.from_pretrained(path)


def test_the_kimi_linear_preset_defaults_to_kimis_format_and_keeps_the_released_keys(tmp_path):
    path = init_model(str(tmp_path / "p"), preset="kimi-linear-tiny", vocab_size=1024, env_ids=("agentrl/Calc-v0",))
    saved = json.load(open(os.path.join(path, "config.json")))
    assert load_chat_format(path).name == "kimi"
    assert saved["mla_use_output_gate"] is False and saved["moe_balancing"] == "none"
    assert "gate_lower_bound" not in saved["linear_attn_config"]  # unbounded, as the release writes it


def test_a_k3_directory_is_imported_in_agentrls_layout(tmp_path):
    source = init_model(str(tmp_path / "p"), preset="tiny", chat_format="kimi_k3", vocab_size=1024,
                        env_ids=("agentrl/Calc-v0",))
    model = HybridMoEForCausalLM.from_pretrained(source)
    k3 = k3_directory(tmp_path, model)
    for name in ("tiktoken.model", "tokenizer_config.json", "generation_config.json"):
        (k3 / name).write_bytes(open(os.path.join(source, name), "rb").read())
    assert needs_import(str(k3)) and not needs_import(source)
    imported = import_checkpoint(str(k3), str(tmp_path / "imported"))
    flat = json.load(open(os.path.join(imported, "config.json")))
    assert flat["model_type"] == "kimi_linear" and "text_config" not in flat and "quantization_config" not in flat
    again = HybridMoEForCausalLM.from_pretrained(imported)
    direct = HybridMoEForCausalLM.from_pretrained(str(k3))
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), direct.state_dict().values()))
    assert load_chat_format(imported).name == "kimi_k3"
    assert load_tokenizer(imported).encode_text("a b 12") == load_tokenizer(source).encode_text("a b 12")


def test_a_checkpoint_takes_only_training_knob_overrides(tmp_path):
    source = init_model(str(tmp_path / "p"), preset="kimi-linear-tiny", vocab_size=1024,
                        env_ids=("agentrl/Calc-v0",))
    view = import_checkpoint(source, str(tmp_path / "view"), {"moe_balancing": "quantile"})
    assert os.path.islink(os.path.join(view, "model.safetensors"))  # the weights stay where they are
    assert HybridMoEConfig.from_pretrained(view).moe_balancing == "quantile"
    with pytest.raises(ValueError, match=r"\['hidden_size'\] cannot change a checkpoint"):
        import_checkpoint(source, str(tmp_path / "bad"), {"hidden_size": 32})
    with pytest.warns(UserWarning, match=r"'initializer_range'.*ignored"):
        job, _ = load_config("configs/quickstart.yaml", [f"model.checkpoint={source}"])
    assert job.model.overrides == {}


def test_a_bad_chat_format_or_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="model.chat_format='llama'"):
        load_config(None, ["model.chat_format=llama"])
    from agentrl.config import check_checkpoint

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no config.json"):
        check_checkpoint(str(tmp_path / "empty"), "model.checkpoint")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        check_checkpoint(str(tmp_path / "empty"), "model.checkpoint")


def test_eval_takes_a_run_directory_and_points_from_a_training_checkpoint_to_the_weights(tmp_path):
    from agentrl.driver import model_directory

    run = tmp_path / "run"
    (run / "weights" / "v7").mkdir(parents=True)
    (run / "weights" / "LATEST").write_text("v7\n")
    (run / "checkpoints" / "step30").mkdir(parents=True)
    assert model_directory(str(run)) == str(run / "weights" / "v7")  # a run directory: its newest weights
    assert model_directory(str(run / "weights" / "v7")) == str(run / "weights" / "v7")
    with pytest.raises(ConfigError, match=r"step30' is a DeepSpeed training checkpoint .*evaluation takes model "
                                          r"weights: .*/run/weights/vN .*the newest is .*/run/weights/v7"):
        model_directory(str(run / "checkpoints" / "step30"))
