"""Every built-in env: registration, check_env, deterministic resets, oracle = 1.0, wrong answer = 0, resumable."""

import json
import warnings

import gymnasium as gym
import pytest
from gymnasium.envs.registration import load_env_creator
from gymnasium.utils.env_checker import check_env

from agentrl.chat import parse_text
from agentrl.chat.agentrl_format import AgentRLFormat
from agentrl.envs import BUILTIN_ENVS, ToolEnv, ToolResults, answer, continue_play, list_envs, make, play
from agentrl.envs import calc, doc_search, kv_chain, python_exec

SMALL = {  # small task sets and documents: the same code paths, fast
    "agentrl/Calc-v0": {"num_tasks": 50},
    "agentrl/PythonExec-v0": {"num_tasks": 20},
    "agentrl/DocSearch-v0": {"num_tasks": 10, "context_tokens": 4096, "page_chars": 2000},
    "agentrl/KVChain-v0": {"num_tasks": 20, "hops": 5},
}
GENERATORS = {"agentrl/Calc-v0": calc.generate_tasks, "agentrl/PythonExec-v0": python_exec.generate_tasks,
              "agentrl/DocSearch-v0": doc_search.generate_tasks, "agentrl/KVChain-v0": kv_chain.generate_tasks}
ENV_IDS = sorted(BUILTIN_ENVS)


@pytest.fixture(scope="module", params=ENV_IDS)
def env(request):
    return make(request.param, **SMALL[request.param])


def test_all_builtin_envs_are_registered_and_listed():
    assert set(ENV_IDS) <= set(list_envs())
    assert ENV_IDS == ["agentrl/Calc-v0", "agentrl/DocSearch-v0", "agentrl/KVChain-v0", "agentrl/PythonExec-v0"]
    assert all(isinstance(gym.spec(i).entry_point, str) for i in ENV_IDS)  # lazy: string entry points


def test_make_accepts_the_short_id_and_rejects_unknown_ones():
    assert isinstance(make("KVChain-v0", num_tasks=2), kv_chain.KVChainEnv)
    with pytest.raises(ValueError, match="agentrl/Calc-v0"):
        make("Nope-v0")


def test_check_env_passes_without_warnings(env):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    assert [str(w.message) for w in caught] == []


def test_gym_make_with_its_wrappers_also_works(env):
    wrapped = gym.make(env.spec.id, **SMALL[env.spec.id])
    prompt, _ = wrapped.reset(seed=0)
    obs, reward, terminated, truncated, info = wrapped.step(parse_text("no tags"))
    assert isinstance(prompt, str) and isinstance(obs, ToolResults) and obs.errors and not terminated


def test_reset_is_deterministic_per_seed(env):
    prompts = [env.reset(seed=s)[0] for s in (0, 1, 2, 3, 0, 1, 2, 3)]
    assert prompts[:4] == prompts[4:] and len(set(prompts[:4])) > 1
    fresh = make(env.spec.id, **SMALL[env.spec.id])
    assert [fresh.reset(seed=s)[0] for s in (0, 1, 2, 3)] == prompts[:4]


@pytest.mark.parametrize("seed", [0, 7])
def test_oracle_scores_one(env, seed):
    episode = play(env, env.oracle, seed=seed)
    assert episode.status == "completed" and episode.terminated
    assert episode.reward == 1.0 and episode.reward_components["correct"] == 1.0
    assert all(not info["errors"] for info in episode.infos), [i["errors"] for i in episode.infos]


def plausible_wrong_answer(env_id, task):
    """A wrong answer of the right shape: a near number, a decoy value from the task, code that fails the tests."""
    if env_id == "agentrl/Calc-v0":
        return answer(str(task["answer"] + 1))
    if env_id == "agentrl/KVChain-v0":
        decoy = next(v for v in json.loads(task["store"]).values() if v.startswith("VAL-") and v != task["answer"])
        return answer(decoy)
    if env_id == "agentrl/DocSearch-v0":
        decoy = next(d["fact"].split(" is ")[-1].rstrip(".") for d in json.loads(task["docs"])
                     if "access code" in d["fact"] and task["answer"] not in d["fact"])
        return answer(decoy)
    return answer(f"```python\ndef {task['function']}(*args):\n    return None\n```")


def test_wrong_final_answer_scores_zero(env):
    episode = play(env, lambda task: [*env.oracle(task)[:-1], plausible_wrong_answer(env.spec.id, task)], seed=0)
    assert episode.status == "completed" and episode.reward == 0.0 and episode.reward_components["correct"] == 0.0


def test_an_episode_resumes_from_saved_state_in_a_fresh_env(env):
    env.reset(seed=3)
    turns = env.oracle(env.task)
    half = len(turns) // 2
    first = continue_play(env, turns[:half], play(env, [], seed=3))
    assert first.status == "running"
    saved = json.loads(json.dumps(env.get_state()))
    fresh = make(env.spec.id, **SMALL[env.spec.id])
    fresh.set_state(saved)
    resumed = continue_play(fresh, turns[half:], first)
    assert resumed.status == "completed" and resumed.reward == 1.0


def test_tools_and_system_prompt(env):
    schemas = env.tool_schemas()
    assert schemas and all(s["type"] == "function" and s["function"]["description"] for s in schemas)
    assert "<" not in env.system_prompt()  # the env's own words, no format markup
    (_, system), *_ = AgentRLFormat().prompt_pieces(env.system_prompt(), schemas, "task")
    prompt = "".join(p.text for p in system)
    assert all(f'"name": "{s["function"]["name"]}"' in prompt for s in schemas) and env.system_prompt() in prompt


def test_task_sets_save_and_load_with_datasets(tmp_path):
    for env_id, generate in GENERATORS.items():
        kwargs = {k: v for k, v in SMALL[env_id].items() if k in ("num_tasks", "hops", "context_tokens")}
        tasks = generate(**kwargs)
        assert tasks.to_list() == generate(**kwargs).to_list()  # deterministic in the seed
        assert tasks.to_list() != generate(**kwargs, seed=1).to_list()
        path = str(tmp_path / env_id.replace("/", "_"))
        tasks.save_to_disk(path)
        page = {"page_chars": 2000} if "DocSearch" in env_id else {}
        from_disk, in_memory = make(env_id, tasks=path, **page), make(env_id, tasks=tasks, **page)
        assert from_disk.reset(seed=4)[0] == in_memory.reset(seed=4)[0]
        assert play(from_disk, from_disk.oracle, seed=4).reward == 1.0


def test_every_registered_agentrl_env_is_a_tool_env():
    for env_id in list_envs():
        assert issubclass(load_env_creator(gym.spec(env_id).entry_point), ToolEnv), env_id
