"""Environments in their own processes, so that a timeout holds even against code that never lets go of the GIL.

A tool that computes for minutes inside one C call (`round(1, -10**9)`, a huge integer power, a regex that
backtracks) holds the GIL for all of it: in a thread of the rollout worker it freezes the worker's event loop, every
other episode and the timeout meant to stop it. So each env instance lives in a process of its own, and the worker
only waits on a socket: when a call overruns, the worker kills that process and fails that one episode.

The processes are forked from a *host* (`python -m agentrl.rollout.env_host`), one per rollout worker, started fresh
(never forked from the worker, whose vLLM and Ray threads a fork would copy half-way). The host imports `agentrl.envs`, `datasets`
and, before the first fork of each env id, the env's module, so a new env process costs a fork and shares those
imports with the host copy-on-write. The
host and its env processes end with the worker however it ends: the host exits and kills its process group when the
worker's end of its socket closes, and every env process dies with the host (PR_SET_PDEATHSIG).

The wire is a length-prefixed pickle per message. An env process answers `("ok", value)` or `("error", (type name,
message, traceback))`: a user's exception need not be picklable to be reported by name.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from typing import Any

_HEADER = struct.Struct("!Q")
_CONTROL_FD = "AGENTRL_ENV_HOST_FD"
_SYS_PATH = "AGENTRL_ENV_HOST_PATH"
BUILD_TIMEOUT_S = 300.0  # building an env (its task set) may take far longer than a step; a build that hangs ends


class EnvCallError(RuntimeError):
    """An env method raised in its process: carries the original exception's type name, message and traceback."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.type_name, self.message, self.remote_traceback = type_name, message, remote_traceback

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


class EnvProcessDied(RuntimeError):
    """The env's process ended while a call was in flight (killed, out of memory, `os._exit` in the env's code)."""


def describe_exception(exc: BaseException) -> str:
    """`Type: message` for an exception raised by the env, in its process or in this one alike."""
    return str(exc) if isinstance(exc, (EnvCallError, EnvProcessDied)) else f"{type(exc).__name__}: {exc}"


# --- the worker's side -----------------------------------------------------------------------------------------------
class ProcessEnv:
    """A handle on one env instance in its own process; `await call(name, ...)` runs `env.name(...)` there. Bound to
    no event loop: each call uses the loop it runs in."""

    def __init__(self, pid: int, sock: socket.socket):
        self.pid, self._sock = pid, sock
        sock.setblocking(False)
        self.max_calls_per_turn = 8

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(self._sock, _frame((name, args, kwargs)))
            (size,) = _HEADER.unpack(await self._recv_exactly(loop, _HEADER.size))
            status, payload = pickle.loads(await self._recv_exactly(loop, size))
        except (EOFError, OSError) as exc:
            raise EnvProcessDied(f"the env's process (pid {self.pid}) died during {name}(): killed, out of memory "
                                 "or exited from the env's own code") from exc
        if status == "error":
            raise EnvCallError(*payload)
        return payload

    async def _recv_exactly(self, loop: asyncio.AbstractEventLoop, n: int) -> bytes:
        buffer = bytearray(n)
        view, got = memoryview(buffer), 0
        while got < n:
            read = await loop.sock_recv_into(self._sock, view[got:])
            if not read:
                raise EOFError
            got += read
        return bytes(buffer)

    def close(self) -> None:
        """Kills the process (a call may still be running in it) and closes the socket."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._sock.close()


class EnvHost:
    """The rollout worker's env-process host: started on first use, restarted if it died, stopped by `close`."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._lock = threading.Lock()  # one fork request at a time on the control socket

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, _CONTROL_FD: str(theirs.fileno()), _SYS_PATH: json.dumps(sys.path)}
        self._proc = subprocess.Popen([sys.executable, "-m", "agentrl.rollout.env_host"], env=env,
                                      pass_fds=(theirs.fileno(),), start_new_session=True, stdin=subprocess.DEVNULL)
        theirs.close()
        self._control = ours

    def _fork(self, env_id: str, spec: bytes | None) -> tuple[int, socket.socket]:
        with self._lock:
            for attempt in (0, 1):  # a host that died (killed with the worker's other children) is started again
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                try:
                    self._control.sendall(_frame((env_id, spec)))
                    data, fds, _, _ = socket.recv_fds(self._control, 8, 1)
                except OSError:
                    data, fds = b"", []
                if len(data) == 8 and fds:
                    return struct.unpack("!q", data)[0], socket.socket(fileno=fds[0])
                self._stop()
            raise RuntimeError(f"the env host (pid {self._proc.pid if self._proc else '?'}) did not fork an env "
                               "process twice in a row")

    async def spawn(self, env_id: str, kwargs: dict[str, Any]) -> ProcessEnv:
        """A new process holding `make(env_id, **kwargs)`; raises what the env's constructor raised."""
        spec = _registered_spec(env_id)
        pid, sock = await asyncio.to_thread(self._fork, env_id, spec)
        env = ProcessEnv(pid, sock)
        try:
            info = await asyncio.wait_for(env.call("__build__", env_id, kwargs, spec),
                                          BUILD_TIMEOUT_S)
        except asyncio.TimeoutError:
            env.close()
            raise EnvCallError("TimeoutError", f"building {env_id} took more than {BUILD_TIMEOUT_S:.0f}s") from None
        except BaseException:
            env.close()
            raise
        env.max_calls_per_turn = info["max_calls_per_turn"]
        return env

    def _stop(self) -> None:
        if self._control is not None:
            self._control.close()  # the host kills its process group when it reads the end of this socket
            self._control = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _registered_spec(env_id: str) -> bytes | None:
    """The env's gymnasium registration, for an env process whose imports would not register it (an env registered
    at run time, e.g. by a test); None when it cannot travel (a lambda entry point) or the id imports its module."""
    import gymnasium as gym

    if ":" in env_id or env_id not in gym.registry:
        return None
    try:
        return pickle.dumps(gym.spec(env_id))
    except Exception:  # an entry point pickle cannot name: the env process must find the id by importing
        return None


def _frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


# --- the host process and its env processes -------------------------------------------------------------------------
def _die_with_parent() -> None:
    """The kernel kills this process when the one that forked it ends (Linux; elsewhere the host's socket EOF)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _recv(sock: socket.socket) -> Any:
    header = _recv_exactly(sock, _HEADER.size)
    return pickle.loads(_recv_exactly(sock, _HEADER.unpack(header)[0]))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _register(env_id: str, spec: bytes | None) -> None:
    """Registers the env from the worker's registration when this process's imports did not."""
    import gymnasium as gym

    import agentrl.envs  # noqa: F401  (registers the built-in envs)

    if spec is not None and env_id not in gym.registry:
        try:
            gym.register(**_spec_kwargs(pickle.loads(spec)))
        except Exception as exc:
            raise ValueError(f"{env_id!r} is registered with an entry point its env process cannot import ({exc}); "
                             "register it as 'module:Class', or set rollout.env_isolation=thread") from None


def _import_entry_point(env_id: str, spec: bytes | None) -> None:
    """Imports the module that defines the env, so that every env process forked afterwards shares it."""
    import gymnasium as gym

    _register(env_id, spec)
    if ":" in env_id:
        importlib.import_module(env_id.split(":")[0])
    entry_point = gym.spec(env_id).entry_point
    if isinstance(entry_point, str):
        importlib.import_module(entry_point.split(":")[0])


def _build(env_id: str, kwargs: dict[str, Any], spec: bytes | None):
    from agentrl.envs import make

    _register(env_id, spec)
    env = make(env_id, **kwargs)
    return env, {"max_calls_per_turn": getattr(env, "max_calls_per_turn", 8)}


def _spec_kwargs(spec) -> dict[str, Any]:
    return {"id": spec.id, "entry_point": spec.entry_point, "max_episode_steps": spec.max_episode_steps,
            "kwargs": dict(spec.kwargs or {})}


def _serve_env(sock: socket.socket) -> None:
    """One env process: the first call builds the env, the others run its methods, until the worker hangs up."""
    env = None
    while True:
        try:
            name, args, kwargs = _recv(sock)
        except (EOFError, ConnectionError):
            return
        try:
            if name == "__build__":
                env, value = _build(*args)
            else:
                value = getattr(env, name)(*args, **kwargs)
            reply = _frame(("ok", value))
        except Exception as exc:
            reply = _frame(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
        except BaseException as exc:  # SystemExit/KeyboardInterrupt from the env's code: report it, then end
            sock.sendall(_frame(("error", (type(exc).__name__, str(exc), traceback.format_exc()))))
            return
        try:
            sock.sendall(reply)
        except (BrokenPipeError, ConnectionError):
            return


def _serve_host(control: socket.socket) -> None:
    """Forks an env process for each request (env id, registration); returns when the worker closes its end."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # env processes are reaped by the kernel
    imported: set[str] = set()
    while True:
        try:
            env_id, spec = _recv(control)
        except (EOFError, ConnectionError):
            return
        if env_id not in imported:
            imported.add(env_id)
            try:
                _import_entry_point(env_id, spec)
            except Exception:  # the env process reports it, with the env's own traceback, when it builds the env
                pass
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            control.close()
            ours.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the env's own subprocesses (the sandbox) need their codes
            _die_with_parent()
            try:
                _serve_env(theirs)
            finally:
                os._exit(0)
        theirs.close()
        socket.send_fds(control, [struct.pack("!q", pid)], [ours.fileno()])
        ours.close()


def main() -> None:
    sys.path[:] = json.loads(os.environ.pop(_SYS_PATH))
    # what every env needs, imported once here and shared by all env processes: agentrl.envs, and datasets (with
    # pyarrow and pandas: ~100 MiB), which ToolEnv's task sets are built with
    import datasets  # noqa: F401

    import agentrl.envs  # noqa: F401
    control = socket.socket(fileno=int(os.environ.pop(_CONTROL_FD)))
    try:
        _serve_host(control)
    finally:
        os.killpg(0, signal.SIGKILL)  # this host and every env process it forked


if __name__ == "__main__":
    main()
