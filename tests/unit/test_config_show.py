"""Self-description: `agentrl config show` lists every key with its default and meaning, every config error names a
dotted key, and a broken YAML file is one line with its file and line."""

import dataclasses
import re
import subprocess
import sys
import typing

import pytest

from agentrl.config import ConfigError, JobConfig, load_config
from agentrl.config_docs import _dataclass_of, _is_list, field_descriptions, show


def all_keys(cls: type = JobConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the job config, walked from the dataclasses independently of config_docs.describe."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = _dataclass_of(hints[f.name])
        if section is not None and not _is_list(hints[f.name]):
            keys += all_keys(section, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def test_config_show_lists_every_key_with_a_description_and_its_default():
    text = show(["configs/quickstart.yaml", "rollout.group_size=2"])
    lines = {line.split(":", 1)[0]: line for line in text.splitlines()[1:] if line and not line.startswith("#")}
    keys = all_keys()
    assert len(keys) > 80 and set(lines) == set(keys)
    assert all("  # " in lines[k] for k in keys), [k for k in keys if "  # " not in lines[k]]
    assert lines["rollout.group_size"].startswith("rollout.group_size: 2 ") and "(default: 4)" in \
        lines["rollout.group_size"]
    assert "(default:" not in lines["rollout.top_p"]  # unchanged keys show no default
    assert "(default: 1e-06)" in lines["trainer.lr"]  # the quickstart's 5e-4 against the typed default
    assert "trainer.loss.kind: ppo" in lines["trainer.loss.kind"]


def test_every_config_class_describes_every_field():
    from agentrl.config import AlgorithmConfig, ClusterConfig, EnvConfig, ModelConfig
    from agentrl.rollout.config import EngineConfig, RolloutConfig
    from agentrl.tracking import TrackingConfig
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.losses import LossConfig

    for cls in (JobConfig, ModelConfig, EnvConfig, EngineConfig, RolloutConfig, AlgorithmConfig, ClusterConfig,
                TrainerConfig, LossConfig, TrackingConfig):
        texts, hints = field_descriptions(cls), typing.get_type_hints(cls)
        leaves = [f.name for f in dataclasses.fields(cls)
                  if _dataclass_of(hints[f.name]) is None or _is_list(hints[f.name])]  # a section is its keys
        missing = [name for name in leaves if not texts.get(name)]
        assert not missing, (cls.__name__, missing)
    assert field_descriptions(LossConfig)["eps_high"].startswith("clip range")  # `a, b: text` describes both
    assert "per rollout worker" == field_descriptions(ClusterConfig)["rollout_cpus"]


def test_the_command_prints_it():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "config", "show", "algorithm.steps=3"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("# the defaults with algorithm.steps=3")
    assert re.search(r"^algorithm\.steps: 3 +# RL steps \(default: 20\)$", out, re.M), out


# one bad value per check a config makes: every message must name the dotted key it is about
BAD = ["rollout.group_size=0", "rollout.group_size=1", "rollout.top_p=0", "rollout.token_budget=0",
       "rollout.engine.dtype=int8", "rollout.engine.implementation=tpu", "algorithm.mode=fast", "algorithm.steps=-1",
       "algorithm.sft_lr=0", "algorithm.sft_target_success=2", "algorithm.sft_eval_every=0",
       "algorithm.max_failed_fraction=1.5", "algorithm.failure_window=0", "env.eval_tasks=5000",
       "model.preset=gpt5", "model.chat_format=llama", "model.vocab_size=10", "model.overrides.hiden_size=8",
       "cluster.trainer_ranks=0", "cluster.placement=anywhere", "trainer.zero_stage=1", "trainer.dtype=fp8",
       "trainer.lr=0", "trainer.micro_batch_tokens=1", "trainer.temperature=0", "trainer.grad_clip=-1",
       "trainer.expert_parallel=0", "trainer.keep_weight_versions=0", "trainer.loss.kind=dpo",
       "trainer.loss.aggregation=sum", "trainer.loss.old_logprobs=engine", "trainer.loss.eps_low=-1",
       "trainer.loss.tis_cap=0", "trainer.loss.mini_batches=0", "trainer.loss.kl_coef=-1",
       "tracking.transcripts_every=-1", "rollout.nope=1", "rollout.group_size=abc"]
DOTTED = re.compile(r"\b(model|env|rollout|algorithm|trainer|tracking|cluster)\.[a-z_]+")


@pytest.mark.parametrize("override", BAD)
def test_every_config_error_names_a_dotted_key(override):
    with pytest.raises(ConfigError) as caught:
        load_config("configs/quickstart.yaml", [override])
    message = str(caught.value)
    assert DOTTED.search(message) and "Config." not in message, message
    assert override.split("=")[0].rsplit(".", 1)[-1] in message, message


def test_a_misspelt_model_override_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"'hiden_size' \(did you mean 'hidden_size'\?\)"):
        load_config(None, ["model.overrides.hiden_size=8"])


def test_group_size_one_is_refused_for_group_baselines_only():
    with pytest.raises(ConfigError, match=r"rollout\.group_size=1 cannot train trainer\.loss\.kind='ppo'"):
        load_config(None, ["rollout.group_size=1"])
    job, _ = load_config(None, ["rollout.group_size=1", "trainer.loss.kind=sft"])
    assert job.rollout.group_size == 1


@pytest.mark.parametrize("text,where", [
    ("rollout:\n  group_size: 4\n   groups_per_step: 2\n", r"bad\.yaml:3:\d+: not valid YAML"),
    ("rollout:\n  group_size: [4\n", r"bad\.yaml:3:1: not valid YAML"),
    ("- a\n- b\n", r"bad\.yaml: a config file is a mapping"),
])
def test_a_broken_yaml_file_is_one_line_naming_file_and_line(tmp_path, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=where) as caught:
        load_config(str(path))
    assert "\n" not in str(caught.value)
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(path)], capture_output=True, text=True)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
