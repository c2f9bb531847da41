"""A user's env package outside the repository: found by `agentrl envs --import`, built with its own kwargs for the
tokenizer's corpus, and named when its code raises."""

import os
import subprocess
import sys

import pytest

from tests.user_package import write_user_package



@pytest.fixture()
def project(tmp_path, monkeypatch):
    """A directory outside the repository holding the package `unitspkg`, importable from it."""
    write_user_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    import gymnasium

    gymnasium.registry.pop("units/Units-v0", None)
    sys.modules.pop("unitspkg.env", None)
    sys.modules.pop("unitspkg", None)


def test_envs_import_lists_a_users_envs_with_their_tools(project):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "envs", "--import", "unitspkg.env"], cwd=project,
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[:2] == ["units/Units-v0  (unitspkg.env:UnitsEnv)",
                                           "    to_metres: Convert a length to metres."]
    assert "env.id=unitspkg.env:units/Units-v0" in out.stdout
    nothing = subprocess.run([sys.executable, "-m", "agentrl.cli", "envs", "--import", "os"], cwd=project, env=env,
                             capture_output=True, text=True)
    assert nothing.returncode == 1 and "registered no environment" in nothing.stderr


def test_the_tokenizer_corpus_builds_the_env_with_its_kwargs_and_names_it_when_it_raises(project):
    from agentrl.chat.tiny_tokenizers import format_corpus
    from agentrl.failures import EnvCodeError

    texts = format_corpus("agentrl", ["unitspkg.env:units/Units-v0"], episodes_per_env=3,
                          env_kwargs={"unitspkg.env:units/Units-v0": {"scale": 2.5}})
    assert len(texts) == 3 and "to_metres" in texts[0]
    with pytest.raises(EnvCodeError, match=r"unitspkg\.env:units/Units-v0: ZeroDivisionError: units env broke"):
        format_corpus("agentrl", ["unitspkg.env:units/Units-v0"], episodes_per_env=1,
                      env_kwargs={"unitspkg.env:units/Units-v0": {"scale": 1.0, "broken": True}})


def test_check_env_takes_the_module_id_form_and_the_envs_own_kwargs(project):
    from agentrl.config import ConfigError, check_env, load_config

    job, _ = load_config("configs/quickstart.yaml", ["env.id=unitspkg.env:units/Units-v0", "env.kwargs.scale=2",
                                                     "env.num_tasks=120"])
    assert job.env.kwargs == {"scale": 2}
    check_env(job)
    job, _ = load_config("configs/quickstart.yaml", ["env.id=unitspkg.env:units/Units-v0", "env.num_tasks=120"])
    with pytest.raises(ConfigError, match=r"env\.kwargs=\{\}: .*missing 1 required keyword-only argument: 'scale'"):
        check_env(job)
