"""docs/environments.md: its complete-environment example runs, fits in 40 lines, and works as a job would use it."""

import re
import sys
from pathlib import Path

import pytest

from agentrl.envs import answer, call, list_envs, make, play

DOC = Path(__file__).resolve().parents[3] / "docs" / "environments.md"


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (first, *_) = blocks
    return first


def test_the_example_is_at_most_40_lines():
    assert len(example().strip().splitlines()) <= 40


def test_the_example_runs_and_its_oracle_scores_one():
    namespace = {"__name__": "docs_example"}
    exec(compile(example(), str(DOC), "exec"), namespace)  # the block asserts reward 1.0 itself
    assert "myproject/Capitals-v0" in list_envs(namespace=None)
    env = make("myproject/Capitals-v0")
    episode = play(env, [answer("Lyon")], seed=0)
    assert episode.status == "completed" and episode.reward == 0.0
    env.reset(seed=0)
    obs, *_ = env.step(call("atlas", country="Mars"))
    assert "no atlas entry for 'Mars'" in obs.results[0].content


@pytest.mark.filterwarnings("ignore:.*Overriding environment")  # the test above registered the same id
def test_the_module_id_form_a_job_uses_imports_and_registers_the_env(tmp_path, monkeypatch):
    (tmp_path / "capitals_doc_example.py").write_text(example())
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make("capitals_doc_example:myproject/Capitals-v0")
    assert type(env).__module__ == "capitals_doc_example" and "capitals_doc_example" in sys.modules
    assert play(env, env.oracle, seed=1).reward == 1.0
