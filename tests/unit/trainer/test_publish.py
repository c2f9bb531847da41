"""Versioned weight directories: atomic, checksummed, loadable, pruned; and the trainer's config checks."""

import os

import pytest
import torch

from agentrl.model.modeling import HybridMoEForCausalLM
from agentrl.trainer import TrainerConfig
from agentrl.trainer.publish import (directory_checksums, latest_weights, state_dict_checksums, tensor_checksum,
                                     write_weights)
from tests.unit.model.conftest import tiny_model


def test_published_directory_loads_back_with_equal_checksums(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.moe_layers[0].gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    state = model.state_dict()
    assert latest_weights(str(tmp_path)) is None
    p = write_weights(state, model.config, str(tmp_path), 7)
    assert p.path == os.path.join(tmp_path, "weights", "v7") and latest_weights(str(tmp_path)) == (7, p.path)
    assert directory_checksums(p.path) == p.checksums == state_dict_checksums(state)
    assert not [n for n in os.listdir(tmp_path / "weights") if n.startswith(".")]  # no temporary left behind
    loaded = HybridMoEForCausalLM.from_pretrained(p.path)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    ids = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=0, atol=0)


def test_checksums_see_one_changed_element_and_the_dtype():
    t = torch.randn(4, 5)
    u = t.clone()
    u[2, 3] += 1e-6
    assert tensor_checksum(t) != tensor_checksum(u)
    assert tensor_checksum(t) != tensor_checksum(t.double())
    assert tensor_checksum(torch.tensor(1.0)) != tensor_checksum(torch.tensor([1.0]))


def test_old_versions_are_pruned_and_a_version_can_be_republished(tmp_path):
    model = tiny_model()
    state = model.state_dict()
    for v in range(4):
        write_weights(state, model.config, str(tmp_path), v, keep_last=2)
    assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST", "v2", "v3"]
    changed = {k: (v + 1 if k == "lm_head.weight" else v) for k, v in state.items()}
    again = write_weights(changed, model.config, str(tmp_path), 3, keep_last=2)
    assert directory_checksums(again.path) == state_dict_checksums(changed) != state_dict_checksums(state)
    assert sorted(n for n in os.listdir(tmp_path / "weights") if not n.startswith(".")) == ["LATEST", "v2", "v3"]
    with pytest.raises(ValueError, match="keep_last"):
        write_weights(state, model.config, str(tmp_path), 4, keep_last=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(zero_stage=1), "zero_stage"), (dict(dtype="fp16"), "dtype"), (dict(lr=0.0), "lr"),
    (dict(micro_batch_tokens=1), "micro_batch_tokens"), (dict(temperature=0.0), "temperature"),
    (dict(keep_weight_versions=0), "keep_weight_versions"),
])
def test_trainer_config_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(run_dir="r", **kwargs)


def test_published_version_carries_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from agentrl.tokenizer import byte_tokenizer

    source = tmp_path / "policy"
    byte_tokenizer().save_pretrained(source)
    model = tiny_model()
    p = write_weights(model.state_dict(), model.config, str(tmp_path), 1, tokenizer_dir=str(source))
    tokenizer = AutoTokenizer.from_pretrained(p.path)
    assert tokenizer.encode("<tool_call>12") == byte_tokenizer().encode("<tool_call>12")
    assert tokenizer.chat_template is not None
    bare = write_weights(model.state_dict(), model.config, str(tmp_path), 2)
    assert not os.path.exists(os.path.join(bare.path, "tokenizer_config.json"))


def test_republishing_a_lower_version_never_leaves_latest_naming_a_pruned_one(tmp_path):
    """A run that resumes from an earlier checkpoint publishes a version again that is lower than the newest on disk
    (issue 27: v0 after v240-v242 was pruned at once, LATEST named it, and every rerun failed to load it)."""
    model = tiny_model()
    for version in (240, 241, 242):
        write_weights(model.state_dict(), model.config, str(tmp_path), version, keep_last=3)
    p = write_weights(model.state_dict(), model.config, str(tmp_path), 0, keep_last=3)
    assert latest_weights(str(tmp_path)) == (0, p.path) and os.path.isdir(p.path)
    assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST", "v0"]  # the abandoned future is gone
    for version in (1, 2, 3):
        write_weights(model.state_dict(), model.config, str(tmp_path), version, keep_last=3)
    assert sorted(os.listdir(tmp_path / "weights")) == ["LATEST", "v1", "v2", "v3"]
