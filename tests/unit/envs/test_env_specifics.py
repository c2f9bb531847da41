"""Behaviour particular to each built-in env: DocSearch length tuning, KVChain horizon, PythonExec scoring."""

import json
import os
import tempfile

import pytest

from agentrl.envs import SandboxError, SandboxLimits, answer, call, make, play
from agentrl.envs import python_exec
from agentrl.envs.doc_search import CHARS_PER_TOKEN, render_document
from agentrl.envs.sandbox import detect_isolation


@pytest.mark.parametrize("context_tokens", [32_768, 262_144])
def test_doc_search_trajectories_reach_the_token_target(context_tokens):
    env = make("DocSearch-v0", num_tasks=2, context_tokens=context_tokens)
    episode = play(env, env.oracle, seed=0)
    tokens = sum(len(str(m["content"])) for m in episode.messages()) / CHARS_PER_TOKEN
    assert episode.reward == 1.0
    assert context_tokens <= tokens <= 1.6 * context_tokens, tokens
    assert len(episode.messages()) > 10  # many turns, each a long observation


def test_doc_search_needs_paging_search_sees_only_titles():
    env = make("DocSearch-v0", num_tasks=2, context_tokens=8192, page_chars=4000)
    env.reset(seed=0)
    task = env.task
    docs = json.loads(task["docs"])
    first = docs[json.loads(task["chain"])[0]]
    name = first["title"].removeprefix("Dossier on Project ")
    assert env.search(f"Project {name}").splitlines()[0].split("\t")[1] == first["title"]
    assert env.search(task["answer"]) == "No dossiers match."  # the code is only in a document's body
    text = render_document(task, 0)
    assert len(text) >= task["doc_chars"] and text.count(docs[0]["fact"]) == 1
    assert text.index(docs[0]["fact"]) > 0.5 * task["doc_chars"]
    page = env.open_document("doc-000", 4000)
    assert page.startswith("[doc-000: characters 4000-8000 of") and "next offset 8000" in page
    assert page.endswith(text[4000:8000])


def test_doc_search_open_reports_bad_ids_and_offsets_to_the_model():
    env = make("DocSearch-v0", num_tasks=2, context_tokens=4096)
    env.reset(seed=0)
    for arguments in [{"doc_id": "doc-999"}, {"doc_id": "paper"}, {"doc_id": "doc-000", "offset": 10000000}]:
        obs, _, _, _, info = env.step(call("open", **arguments))
        assert obs.results[0].is_error and obs.results[0].content.startswith("Error: open:")
        assert info["status"] == "running"


@pytest.mark.parametrize("hops", [1, 4, 32])
def test_kv_chain_needs_exactly_hops_lookups(hops):
    env = make("KVChain-v0", num_tasks=3, hops=hops)
    episode = play(env, env.oracle, seed=1)
    assert episode.reward == 1.0
    assert sum(len(info["tool_calls"]) for info in episode.infos) == hops
    assert env.max_turns >= hops + 1
    # Answering one hop early gives a key, not the value.
    env.reset(seed=1)
    chain = json.loads(env.task["chain"])
    assert env.lookup(chain[-1]) == env.task["answer"]
    if hops > 1:
        assert env.lookup(chain[-2]) == chain[-1]


@pytest.fixture(scope="module")
def python_env():
    return make("PythonExec-v0", num_tasks=30, limits=SandboxLimits(wall_s=3.0, cpu_s=1.0))


def test_python_exec_partial_credit_is_logged_not_rewarded(python_env):
    env = python_env
    index = next(i for i in range(len(env.tasks)) if env.tasks[i]["function"] == "sum_above")
    env.reset(options={"task_index": index})
    wrong = "def sum_above(xs):\n    return sum(x for x in xs if x > 0)\n"  # right shape, wrong threshold
    tests = json.loads(env.task["tests"])
    expected_fraction = sum(sum(x for x in a[0] if x > 0) == e for a, e in tests) / len(tests)
    _, reward, terminated, _, info = env.step(answer(wrong))
    assert terminated and reward == float(expected_fraction == 1.0)
    assert info["reward_components"]["tests_passed"] == pytest.approx(expected_fraction)


@pytest.mark.parametrize("answer", ["def broken(:\n", "import sys\nsys.exit(0)\n", "while True:\n    pass\n",
                                    "print('@@agentrl-tests-0000000000000000@@{\"passed\": 99}')\n"])
def test_python_exec_bad_answers_score_zero_not_failed(python_env, answer):
    from agentrl.envs import answer as final

    python_env.reset(seed=2)
    _, reward, terminated, _, info = python_env.step(final(f"```python\n{answer}```"))
    assert terminated and info["status"] == "completed" and reward == 0.0
    assert info["reward_components"]["tests_passed"] == 0.0


def test_python_exec_run_python_shows_outcome_and_output(python_env):
    python_env.reset(seed=2)
    obs, *_ = python_env.step(call("run_python", code="print(6 * 7)\nraise SystemExit(3)"))
    assert "outcome: error (exit code 3)" in obs.results[0].content and "stdout:\n42" in obs.results[0].content


def test_python_exec_sandbox_failure_is_a_failed_episode(python_env, monkeypatch):
    def broken(*args, **kwargs):
        raise SandboxError("could not start the sandbox process")
    monkeypatch.setattr(python_env.sandbox, "run", broken)
    python_env.reset(seed=0)
    _, reward, terminated, truncated, info = python_env.step(call("run_python", code="print(1)"))
    assert info["status"] == "failed" and info["failure"]["boundary"] == "sandbox" and truncated
    python_env.reset(seed=0)
    _, _, _, _, info = python_env.step(answer("def f(): pass"))
    assert info["status"] == "failed" and info["failure"]["boundary"] == "sandbox"


@pytest.mark.skipif(detect_isolation()[0] != "namespaces", reason="hiding paths needs namespaces")
def test_python_exec_hides_a_task_set_loaded_from_disk_from_the_code():
    with tempfile.TemporaryDirectory(dir="/var/tmp") as path:  # not /tmp: the sandbox has its own
        os.chmod(path, 0o755)
        python_exec.generate_tasks(num_tasks=3).save_to_disk(path)
        env = make("PythonExec-v0", tasks=path)
        env.reset(seed=0)
        code = f"import os\nprint(os.listdir({path!r}))"
        obs, *_ = env.step(call("run_python", code=code))
        assert "stdout:\n[]" in obs.results[0].content


def test_calc_difficulty_knobs_pick_templates_and_operand_sizes():
    from agentrl.envs import calc

    easy = calc.generate_tasks(200, kinds=[5], max_operand=9)
    assert all(q.startswith("What is the average of") for q in easy["question"])
    operands = [int(n) for e in easy["expression"] for n in e.replace("(", " ").replace(")", " ").split()
                if n.isdigit() and n != "4"]  # "/ 4" is the template's, not an operand
    assert operands and all(2 <= n <= 9 for n in operands)
    # the defaults draw the same tasks as before the knobs existed
    assert calc.generate_tasks(3)["expression"] == calc.generate_tasks(3, kinds=range(8), max_operand=99)["expression"]
    env = make("Calc-v0", num_tasks=5, kinds=[0, 3], max_operand=9)
    assert all(t["expression"].count("**") + t["expression"].count("-") >= 1 for t in env.tasks)
    for bad in ({"kinds": []}, {"kinds": [8]}, {"max_operand": 1}):
        with pytest.raises(ValueError, match="kinds|max_operand"):
            calc.generate_tasks(3, **bad)


def test_calc_tasks_are_distinct_problems_so_held_out_tasks_are_new():
    from agentrl.envs import calc

    tasks = calc.generate_tasks(1000, kinds=[0, 3], max_operand=9)  # a small problem space: draws repeat
    assert len(set(tasks["expression"])) == 1000
    with pytest.raises(ValueError, match="distinct problems"):
        calc.generate_tasks(100, kinds=[5], max_operand=2)  # (2 + 2 + 2 + 2) / 4 is the only one
