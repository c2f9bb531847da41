"""Gold trajectories: an environment's oracle turns rendered by the model's chat format, as the agent loop renders a
policy's turns.

For SFT warm starts (the trainer's SFT mode trains on the loss-masked assistant tokens) and for tests: a trajectory
built here has the same token layout as one sampled by `AgentLoop` — the prompt, each oracle turn as the model would
write it (closed by the format's end marker, loss mask 1, log-probabilities 0), and the glue after it — and the env
steps each turn as the format parses it back, exactly what it would get from a policy that wrote those tokens.
"""

from __future__ import annotations

from agentrl.chat import ChatFormat
from agentrl.types import Status, Trajectory, Turn


def oracle_trajectory(env, chat: ChatFormat, *, env_id: str, task_index: int, seed: int = 0,
                      group_id: str | None = None) -> Trajectory:
    """Plays `env.oracle` on task `task_index` and returns the token-exact trajectory."""
    observation, info = env.reset(seed=seed, options={"task_index": task_index})
    task_id = str(info.get("task_id", task_index))
    traj = Trajectory(trajectory_id=f"oracle-{env_id}-{task_index}-{seed}", task_id=task_id,
                      group_id=group_id or f"oracle-{task_id}", env_id=env_id)
    prompt = chat.render_prompt(env.system_prompt(), env.tool_schemas(), observation)
    traj.append_prompt(prompt.ids)
    traj.turns += [Turn(role=role, start=start, end=end, text=text) for role, start, end, text in prompt.spans]
    traj.prompt_length = len(traj.tokens)
    for gold in env.oracle(env.task):
        start = len(traj.tokens)
        ids = chat.render_turn(gold)
        traj.append_sampled(ids, [0.0] * len(ids), version=-1)
        traj.turns.append(Turn(role="assistant", start=start, end=len(traj.tokens),
                               text=chat.tokenizer.decode(ids[:-1])))
        turn = chat.parse_turn(ids, max_calls=getattr(env, "max_calls_per_turn", 8))
        observation, reward, terminated, truncated, info = env.step(turn)
        traj.tool_calls.extend(info.get("tool_calls", []))
        if terminated or truncated:
            traj.reward = float(reward)
            traj.reward_components = dict(info.get("reward_components", {}))
            traj.status = Status.COMPLETED if terminated else Status.TRUNCATED
            return traj
        start = len(traj.tokens)
        traj.append_prompt(chat.render_observation(observation))
        traj.turns.append(Turn(role="tool", start=start, end=len(traj.tokens),
                               text=chat.tokenizer.decode(traj.tokens[start:])))
    traj.status = Status.TRUNCATED
    traj.error = "the oracle's messages ran out before the episode ended"
    return traj
