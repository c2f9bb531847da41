"""Lossless resume (issue 27): a running episode reports its progress and a snapshot at each turn boundary; an
episode resumed from its snapshot ends where the uninterrupted one does. A scripted engine stands in for vLLM."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.rollout.agent_loop import AgentLoop, EpisodeRequest
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy_engine import Generation
from agentrl.rollout.snapshots import SnapshotReporter
from agentrl.types import Status, Trajectory
from agentrl.chat import get_format
from agentrl.chat.tokenizers import HFTokenizer
from agentrl.tokenizer import byte_tokenizer
from tests.unit.rollout.test_env_isolation import ScriptedEngine, request


class RecordingStore:
    """Stands in for the store actor: `report.remote` records what the worker sent."""

    def __init__(self):
        self.reports: list[tuple[list[Trajectory], dict]] = []
        self.report = self

    def remote(self, snapshots, progress):
        self.reports.append((snapshots, dict(progress)))


class SlowEngine(ScriptedEngine):
    """Takes 0.2 s a turn, as a real one does: the reporter's reports land while the episode runs."""

    async def generate(self, prompt_ids, sampling, stop_token_ids, into=None):
        await asyncio.sleep(0.2)
        return await super().generate(prompt_ids, sampling, stop_token_ids, into)


def thread_loop() -> AgentLoop:
    chat = get_format("agentrl", HFTokenizer(byte_tokenizer()))
    return AgentLoop(SlowEngine(chat), chat, RolloutConfig(env_isolation="thread", max_trajectory_tokens=100_000))


def test_an_episode_resumed_from_its_snapshot_ends_as_the_uninterrupted_one():
    loop, store = thread_loop(), RecordingStore()
    reporter = SnapshotReporter(store, interval_s=0.01)

    async def run():
        episode = await loop.run(request("ok"), reporter=reporter)
        reporter.report()  # what was pending when the episode ended is dropped: only the running ones report
        return episode

    whole = asyncio.run(run())
    snapshots = [t for snaps, _ in store.reports for t in snaps]
    assert whole.status == Status.COMPLETED and len(snapshots) == 1, store.reports
    assert max(n for _, progress in store.reports for n, _ in progress.values()) <= whole.num_sampled
    (snap,) = snapshots  # after the tool's answer: the one turn boundary of this episode
    assert snap.status == Status.PARTIAL and snap.env_state and snap.tokens == whole.tokens[: len(snap.tokens)]
    assert snap.num_sampled < whole.num_sampled and snap.timings["episode_s"] > 0
    resumed = asyncio.run(loop.run(EpisodeRequest.of(snap), resume=snap))
    assert resumed.status == Status.COMPLETED and resumed.reward == whole.reward == 1.0
    assert (resumed.tokens, resumed.loss_mask, resumed.logprobs) == (whole.tokens, whole.loss_mask, whole.logprobs)
    assert [(t.role, t.start, t.end) for t in resumed.turns] == [(t.role, t.start, t.end) for t in whole.turns]


def test_progress_counts_the_turn_being_streamed():
    reporter = SnapshotReporter(RecordingStore(), interval_s=60)
    t = Trajectory(trajectory_id="x", task_id="0", group_id="g", env_id="e")
    t.append_prompt([1, 2])
    t.append_sampled([3, 4], [0.0, 0.0], 0)

    async def run():
        reporter.started(t)
        turn = Generation(token_ids=[5, 6, 7])
        reporter.streaming("x", turn)
        reporter.report()
        reporter.ended("x")
        reporter.report()

    asyncio.run(run())
    (snaps, progress), = reporter.store.reports  # nothing is sent once the episode ended
    assert snaps == [] and progress["x"][0] == 2 + 3


def test_resuming_what_the_agent_loop_did_not_start_is_refused():
    t = Trajectory(trajectory_id="x", task_id="0", group_id="g", env_id="e", status=Status.PARTIAL)
    with pytest.raises(ValueError, match="cannot be resumed: it holds no episode state"):
        EpisodeRequest.of(t)


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval must be > 0"):
        SnapshotReporter(RecordingStore(), interval_s=0)
