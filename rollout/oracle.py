"""Gold trajectories: an environment's oracle turns rendered exactly as the agent loop renders a policy's turns.

For SFT warm starts (the trainer's SFT mode trains on the loss-masked assistant tokens) and for tests: a trajectory
built here has the same token layout as one sampled by `AgentLoop`, with the oracle's messages in the assistant
turns (each closed by <|im_end|>, loss mask 1) and log-probabilities 0.
"""

from __future__ import annotations

from agentrl.tokenizer import IM_END, message_text, turn_glue
from agentrl.types import Status, Trajectory, Turn


def oracle_trajectory(env, tokenizer, *, env_id: str, task_index: int, seed: int = 0,
                      group_id: str | None = None) -> Trajectory:
    """Plays `env.oracle` on task `task_index` and returns the token-exact trajectory."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    observation, info = env.reset(seed=seed, options={"task_index": task_index})
    task_id = str(info.get("task_id", task_index))
    traj = Trajectory(trajectory_id=f"oracle-{env_id}-{task_index}-{seed}", task_id=task_id,
                      group_id=group_id or f"oracle-{task_id}", env_id=env_id)
    for role, content in (("system", env.system_prompt()), ("user", observation)):
        start = len(traj.tokens)
        traj.append_prompt(encode(message_text(role, content)))
        traj.turns.append(Turn(role=role, start=start, end=len(traj.tokens), text=content))
    traj.append_prompt(encode("<|im_start|>assistant\n"))
    traj.prompt_length = len(traj.tokens)
    for text in env.oracle(env.task):
        start = len(traj.tokens)
        ids = encode(text + IM_END)
        traj.append_sampled(ids, [0.0] * len(ids), version=-1)
        traj.turns.append(Turn(role="assistant", start=start, end=len(traj.tokens), text=text))
        observation, reward, terminated, truncated, info = env.step(text)
        if terminated or truncated:
            traj.reward = float(reward)
            traj.reward_components = dict(info.get("reward_components", {}))
            traj.status = Status.COMPLETED if terminated else Status.TRUNCATED
            return traj
        start = len(traj.tokens)
        traj.append_prompt(encode(turn_glue("tool", observation)))
        traj.turns.append(Turn(role="tool", start=start, end=len(traj.tokens), text=observation))
    traj.status = Status.TRUNCATED
    traj.error = "the oracle's messages ran out before the episode ended"
    return traj
