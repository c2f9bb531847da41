"""Run untrusted Python in a subprocess with limits: the sandbox behind code tools such as ``run_python``.

Every run is a fresh process (``python -I -S -B envs/sandbox_child.py``) with:

* **limits** (``setrlimit``): CPU seconds, address space, process count, file size, open files; plus a wall-clock
  deadline enforced by the host, which kills the whole process group.
* **a clean environment**: only PATH, HOME, TMPDIR, LANG; no host variables, no site-packages (stdlib only).
* **a private work directory**, and output truncated to ``max_output_bytes`` per stream.
* **isolation**, the strongest the machine allows (``isolation="auto"`` picks it once per process):

  - ``"namespaces"`` (``unshare`` works: as root, or unprivileged user namespaces): new network namespace (only a
    downed loopback, so no network at all), mount namespace with every mount read-only except a private tmpfs at
    ``/tmp`` (the work dir, ``disk_mb`` large), ``/root``, ``/home`` and any other ``hidden_paths`` replaced by
    empty directories, a PID namespace (nothing survives the run) with its own ``/proc`` (host processes invisible).
  - ``"rlimits"`` (fallback, e.g. a container without CAP_SYS_ADMIN): a host temp dir, the rlimits, and an audit
    hook in the child that refuses sockets, writes outside the work dir, reading other processes' ``/proc``,
    starting programs and ctypes. Best effort against careless code, not a security boundary.

  Started as root, the code also runs as an unprivileged uid (one per run from ``SANDBOX_UID_BASE``), because
  root ignores ``RLIMIT_NPROC`` and file permissions.

Outcomes: code that ran is a ``SandboxResult`` whose ``outcome`` says how it ended ("ok", "error", "timeout",
"cpu_limit", "memory_limit", "killed") - all the code's doing. A sandbox that failed to start, crashed, or ran out
of wall time before the code started raises ``SandboxError``: an infrastructure failure, never the model's fault.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from agentrl.envs.errors import SandboxError
from agentrl.reaper import descendants

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
SANDBOX_UID_BASE = 200_000  # uids SANDBOX_UID_BASE .. + _UID_SPAN, used only when the host runs as root
_UID_SPAN = 100_000
_uid_counter = itertools.count()
MEMORY_POLL_S = 0.05  # how often the host sums the run's resident memory
_PAGE = os.sysconf("SC_PAGE_SIZE")
_NS_FLAGS = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]

Isolation = Literal["auto", "namespaces", "rlimits"]
Outcome = Literal["ok", "error", "timeout", "cpu_limit", "memory_limit", "killed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """Per-run limits. Defaults suit a unit-test run of a small function."""

    wall_s: float = 10.0  # host-enforced deadline for the whole run
    cpu_s: float = 5.0  # RLIMIT_CPU of the code (rounded up to whole seconds)
    memory_mb: int = 512  # RLIMIT_AS of each of the code's processes
    # resident memory of all the run's processes together, counted by the host every MEMORY_POLL_S; None: memory_mb
    run_memory_mb: int | None = None
    max_processes: int = 32  # RLIMIT_NPROC: processes and threads the code may have at once
    max_output_bytes: int = 16_384  # kept of each of stdout and stderr; the rest is read and dropped
    disk_mb: int = 64  # the work tmpfs size, and RLIMIT_FSIZE
    max_open_files: int = 256

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_processes", "max_output_bytes", "disk_mb",
                     "max_open_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.run_memory_mb is not None and self.run_memory_mb <= 0:
            raise ValueError(f"SandboxLimits.run_memory_mb must be > 0 or None, got {self.run_memory_mb!r}")

    @property
    def run_memory_cap_mb(self) -> int:
        return self.memory_mb if self.run_memory_mb is None else self.run_memory_mb


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """How the code ended. ``returncode`` is negative for a signal, as in ``subprocess``."""

    outcome: Outcome
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@functools.cache
def detect_isolation() -> tuple[str, tuple[str, ...]]:
    """("namespaces", unshare prefix) if ``unshare`` works here, else ("rlimits", ()). Probed once per process."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "rlimits", ()
    candidates = [[unshare, *_NS_FLAGS]] if os.geteuid() == 0 else []
    candidates.append([unshare, "--user", "--map-root-user", *_NS_FLAGS])
    for prefix in candidates:
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return "namespaces", tuple(prefix)
    return "rlimits", ()


@dataclass
class _Stream:
    limit: int
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if len(chunk) > room:
            self.truncated = True
        self.data += chunk[: max(room, 0)]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


class Sandbox:
    """Runs code strings under ``limits``. Stateless between runs; safe to share within a thread."""

    def __init__(self, limits: SandboxLimits | None = None, *, isolation: Isolation = "auto",
                 python: str = sys.executable, hidden_paths: Sequence[str] = ("/root", "/home")) -> None:
        """``hidden_paths``: directories replaced by empty ones in "namespaces" mode (home directories by default;
        add where task data such as hidden tests lives, since the rest of the filesystem stays readable)."""
        if isolation not in ("auto", "namespaces", "rlimits"):
            raise ValueError(f"isolation must be 'auto', 'namespaces' or 'rlimits', got {isolation!r}")
        self.limits = limits or SandboxLimits()
        mode, prefix = detect_isolation()
        if isolation == "namespaces" and mode != "namespaces":
            raise ValueError("isolation='namespaces' but `unshare` does not work on this machine; use 'auto'")
        self.isolation = mode if isolation == "auto" else isolation
        self._prefix = prefix if self.isolation == "namespaces" else ()
        self.python = python
        self.hidden_paths = tuple(os.path.realpath(p).rstrip("/") for p in hidden_paths)
        if not all(os.path.isabs(p) and p != "/" for p in hidden_paths):
            raise ValueError(f"hidden_paths must be absolute directories other than '/', got {list(hidden_paths)!r}")

    def run(self, code: str, *, files: Mapping[str, str] | None = None) -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh work dir that also holds ``files`` (relative name -> text).

        Raises ``SandboxError`` when the sandbox, not the code, failed; ``ValueError`` for a bad file name.
        """
        files = {**(files or {}), "main.py": code}
        for name in files:
            if os.path.isabs(name) or ".." in name.split("/") or not name.strip("/"):
                raise ValueError(f"sandbox file names must be relative paths inside the work dir, got {name!r}")
        uid = SANDBOX_UID_BASE + (os.getpid() * 977 + next(_uid_counter)) % _UID_SPAN if os.geteuid() == 0 else None
        host_dir = None
        if self.isolation == "namespaces":
            workdir = "/tmp"  # a fresh tmpfs inside the mount namespace; the host's /tmp is untouched
        else:
            host_dir = workdir = tempfile.mkdtemp(prefix="agentrl-sandbox-")
            if uid is not None:
                os.chown(host_dir, uid, uid)
        try:
            return self._run(files, workdir, uid)
        finally:
            if host_dir is not None:
                shutil.rmtree(host_dir, ignore_errors=True)

    def _run(self, files: dict[str, str], workdir: str, uid: int | None) -> SandboxResult:
        limits = self.limits
        report_r, report_w = os.pipe()
        config = {
            "mode": self.isolation, "workdir": workdir, "uid": uid, "files": files, "entry": "main.py",
            "report_fd": report_w, "guard": self.isolation == "rlimits", "disk_mb": limits.disk_mb,
            "hide": list(self.hidden_paths), "keep": _interpreter_paths(self.python, self.hidden_paths),
            "limits": {
                "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "disk_mb": limits.disk_mb,
                "max_open_files": limits.max_open_files, "nproc": _nproc_limit(limits.max_processes, uid),
            },
        }
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8"}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [*self._prefix, self.python, "-I", "-S", "-B", CHILD_SCRIPT], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(report_w,), env=env, cwd="/",
                start_new_session=True)
        except OSError as exc:
            os.close(report_r)
            raise SandboxError(f"could not start the sandbox process: {exc}") from exc
        finally:
            os.close(report_w)
        out, err = _Stream(limits.max_output_bytes), _Stream(limits.max_output_bytes)
        report = _Stream(4096)
        sweep_uid = uid if self.isolation == "rlimits" else None
        memory = _MemoryWatch(proc.pid, uid, limits.run_memory_cap_mb)
        try:
            timed_out = _pump(proc, json.dumps(config).encode(), out, err, report, report_r, start + limits.wall_s,
                              lambda: _kill(proc, sweep_uid), memory)
        finally:
            _kill(proc, sweep_uid)
            proc.wait()
            os.close(report_r)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):  # read through their fds: close them ourselves
                try:
                    pipe.close()
                except OSError:  # stdin: the child may have gone with data still buffered
                    pass
        wall = time.monotonic() - start
        lines = report.text().splitlines()
        ready = "ready" in lines
        if memory.exceeded and ready:  # killed by the host: the supervisor may not have reported an exit
            return SandboxResult(outcome="memory_limit", returncode=-signal.SIGKILL, stdout=out.text(),
                                 stderr=err.text() + f"\nsandbox: the run's processes held {memory.peak_mb:.0f} MiB "
                                 f"together, over run_memory_mb={limits.run_memory_cap_mb}\n", wall_s=wall,
                                 isolation=self.isolation, stdout_truncated=out.truncated,
                                 stderr_truncated=err.truncated)
        exits = [int(line.split()[1]) for line in lines if line.startswith("exit ")]
        if not ready:
            why = next((line for line in lines if line.startswith("setup-failed")), None) or err.text()[-2000:]
            if timed_out:
                raise SandboxError(f"sandbox did not start within wall_s={limits.wall_s}s: {why}")
            raise SandboxError(f"sandbox failed to start (exit {proc.returncode}): {why}")
        # An exit report wins over the deadline: processes the code left behind may have held the pipes open.
        if exits:
            outcome: Outcome = _classify(exits[0], err.text())
        elif timed_out:
            outcome = "timeout"
        else:
            raise SandboxError(f"sandbox supervisor died without a report (exit {proc.returncode})")
        return SandboxResult(outcome=outcome, returncode=exits[0] if exits else None, stdout=out.text(),
                             stderr=err.text(), wall_s=wall, isolation=self.isolation,
                             stdout_truncated=out.truncated, stderr_truncated=err.truncated)


def _classify(returncode: int, stderr: str) -> Outcome:
    if returncode == 0:
        return "ok"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit"
    if returncode == -signal.SIGKILL:
        return "killed"  # the hard RLIMIT_CPU, or the kernel's OOM killer
    tail = stderr.rstrip().rsplit("\n", 1)[-1]
    if tail.startswith("MemoryError"):
        return "memory_limit"
    return "error"


class _MemoryWatch:
    """The run's resident memory, all its processes together: every process below the sandbox's first one (a
    process that called setsid is still below it) and, when the run has its own uid, every process of that uid
    (one whose parent died and was adopted elsewhere). RLIMIT_AS bounds each process; this bounds their sum."""

    def __init__(self, root: int, uid: int | None, cap_mb: int):
        self.root, self.uid, self.cap_mb = root, uid, cap_mb
        self.peak_mb, self.exceeded, self._next = 0.0, False, 0.0

    def over(self) -> bool:
        """Samples at most every MEMORY_POLL_S; True once the sum went over the cap."""
        now = time.monotonic()
        if now >= self._next and not self.exceeded:
            self._next = now + MEMORY_POLL_S
            pids = {self.root, *descendants(self.root)} | set(_pids_of(self.uid) if self.uid is not None else ())
            self.peak_mb = max(self.peak_mb, sum(_resident_bytes(p) for p in pids) / (1 << 20))
            self.exceeded = self.peak_mb > self.cap_mb
        return self.exceeded


def _resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _pump(proc: subprocess.Popen, stdin: bytes, out: _Stream, err: _Stream, report: _Stream, report_fd: int,
          deadline: float, kill, memory: _MemoryWatch) -> bool:
    """Feed stdin, read the three pipes until all close, the deadline passes (returns True) or the run's memory
    goes over its cap (kills it; `memory.exceeded` says so)."""
    sel = selectors.DefaultSelector()
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, None)
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, out)
    sel.register(proc.stderr.fileno(), selectors.EVENT_READ, err)
    sel.register(report_fd, selectors.EVENT_READ, report)
    pending = memoryview(stdin)
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                kill()
                return True
            if memory.over():
                kill()
                return False
            for key, _ in sel.select(min(remaining, MEMORY_POLL_S)):
                if key.data is None:  # stdin
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except (BrokenPipeError, BlockingIOError) as exc:
                        if isinstance(exc, BlockingIOError):
                            continue
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if chunk:
                    key.data.feed(chunk)
                    if key.data is report and b"exit " in report.data:
                        kill()  # the code has finished: end whatever it left behind so the pipes close
                else:
                    sel.unregister(key.fd)
        return False
    finally:
        sel.close()


def _kill(proc: subprocess.Popen, sweep_uid: int | None) -> None:
    """SIGKILL the run's process group and, if ``sweep_uid`` is given, every process of that uid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    # Code that called setsid() left our process group; only its uid still finds it. Sweep until none is left: a
    # fork bomb refills its process slots while we kill. (In "namespaces" mode the PID namespace takes everything
    # down, so no sweep is needed there.)
    for _ in range(100 if sweep_uid is not None else 0):
        pids = _pids_of(sweep_uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pids_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is ``uid``, from /proc/PID/status (/proc/PID's owner changes
    after setuid, so it cannot be used)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
            real_uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
        except (OSError, KeyError, ValueError, IndexError):
            continue
        if real_uid == uid and state != "Z":
            pids.append(int(entry))
    return pids


def _nproc_limit(max_processes: int, uid: int | None) -> int:
    """RLIMIT_NPROC counts every process of the real uid: add what the uid already runs unless it is our own."""
    return max_processes if uid is not None else len(_pids_of(os.getuid())) + max_processes


@functools.cache
def _interpreter_paths(python: str, hidden: tuple[str, ...]) -> list[str]:
    """The install directories of ``python`` that sit under a directory the sandbox hides."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        prefixes = [sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix]
    else:  # another interpreter: assume the usual <prefix>/bin/python layout rather than run it here
        prefixes = [os.path.dirname(os.path.dirname(os.path.realpath(python)))]
    paths = {os.path.realpath(p) for p in prefixes}
    under = sorted(p for p in paths if any(p.startswith(h.rstrip("/") + "/") for h in hidden))
    return [p for p in under if not any(p != q and p.startswith(q + "/") for q in under)]
