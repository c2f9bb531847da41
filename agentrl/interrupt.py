"""Stopping a job cleanly: SIGINT / SIGTERM ask the driver to stop at the next step boundary, with a checkpoint.

    with StopRequest() as stop:
        ...
        if stop.requested:                 # the loop checks at each step's end
            save_checkpoint(...)
            raise JobInterrupted(stop.signal_name, where="RL step 7")

The first signal only sets the flag (the step in progress finishes, a checkpoint is written, the actors and the
MLflow run are closed, and the command that started the job resumes it); a second one interrupts at once, as
Ctrl-C always does. Outside the main thread (a job run from a notebook worker thread, say) no handler can be
installed and signals keep their default behaviour.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("agentrl")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class JobInterrupted(Exception):
    """The job stopped on a signal, after checkpointing; rerunning the same command resumes it."""

    def __init__(self, signal_name: str, where: str, exit_code: int):
        super().__init__(f"stopped by {signal_name} at {where}, after a checkpoint: run the same command to resume")
        self.signal_name, self.where, self.exit_code = signal_name, where, exit_code


class StopRequest:
    """A flag the driver polls, set by the first SIGINT or SIGTERM while the context is active."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def interrupted(self, where: str) -> JobInterrupted:
        return JobInterrupted(self.signal_name, where, 128 + (self.signum or 0))

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal: stop now, without the checkpoint
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s received: stopping after the current step (a checkpoint is written; the same command "
                    "resumes). Send it again to stop at once.", signal.Signals(signum).name)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
