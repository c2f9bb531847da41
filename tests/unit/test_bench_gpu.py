"""scripts/bench_gpu.py's retry with gradient checkpointing after an out-of-memory step: the failed step's memory
must be free when the retry runs (K3's width at 8K tokens read "OOM" for a step that fits, because the retry ran
inside the `except` block, whose traceback kept the failed forward's activations alive); and its trainer table's
wait on a process that dies without a result."""

import weakref

import torch

from tests.scripts import load_script


def _script():
    return load_script("bench_gpu")


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.checkpointing = False

    def gradient_checkpointing_enable(self):
        self.checkpointing = True

    def gradient_checkpointing_disable(self):
        self.checkpointing = False


def test_the_retry_with_checkpointing_runs_after_the_failed_step_released_its_memory(monkeypatch):
    bench = _script()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    attempts = []

    def step_time(model, loss_fn, tokens, repeats):
        activations = torch.empty(1024)  # what a failed forward holds in its frames
        attempts.append((model.checkpointing, weakref.ref(activations),
                         [ref() is not None for _, ref, _ in attempts]))
        if not model.checkpointing:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return 0.5

    monkeypatch.setattr(bench, "step_time", step_time)
    built = bench.Built(_Model(), total=10, active=10)
    tokens_per_s, _, _, note = bench.measure(built, loss_fn=None, tokens=1000)
    assert [checkpointing for checkpointing, _, _ in attempts] == [False, True]
    assert attempts[1][2] == [False], "the failed step's tensors were still alive when the retry began"
    assert (tokens_per_s, note) == ("2,000", "ckpt")
    assert not built.model.checkpointing


def test_a_step_that_runs_out_of_memory_with_checkpointing_too_reads_oom(monkeypatch):
    bench = _script()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def step_time(model, loss_fn, tokens, repeats):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(bench, "step_time", step_time)
    built = bench.Built(_Model(), total=10, active=10)
    assert bench.measure(built, loss_fn=None, tokens=1000) == ("OOM", "", "", "")
    assert not built.model.checkpointing


def _put_then_exit(results):
    results.put("measured")


def _exit_without_putting(results):
    del results


def test_the_trainer_table_takes_a_processs_result_and_moves_on_when_one_dies_without_one():
    """A trainer-table process that runs out of memory ends without a result: the parent reports the row and goes
    on, where it waited out its 500 s before (at Kimi Linear's width on an H100, session 36)."""
    import multiprocessing

    bench = _script()
    ctx = multiprocessing.get_context("spawn")
    for target, expected in ((_put_then_exit, "measured"), (_exit_without_putting, None)):
        results = ctx.Queue()
        proc = ctx.Process(target=target, args=(results,))
        proc.start()
        assert bench._result_or_death(proc, results, timeout_s=60) == expected
        proc.join()
