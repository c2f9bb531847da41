"""Small networking helpers (no heavy imports: Ray tasks and spawned ranks call them before anything else loads)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it; another process could still take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
