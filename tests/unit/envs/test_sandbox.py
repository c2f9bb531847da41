"""The sandbox contains network access, writes outside its dir, fork and memory bombs, infinite loops and host
secrets; reports each; leaves the host unaffected; and tells its own failures apart from the code's."""

import ast
import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from agentrl.envs import Sandbox, SandboxError, SandboxLimits
from agentrl.envs.sandbox import CHILD_SCRIPT, detect_isolation

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1.0, memory_mb=256, max_processes=16, max_output_bytes=4096)
SHORT = SandboxLimits(wall_s=1.5, cpu_s=1.0, memory_mb=256, max_processes=16, max_output_bytes=4096)
NAMESPACES = detect_isolation()[0] == "namespaces"
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def modes():
    """Each isolation mode this machine can test. The "rlimits" fallback needs an interpreter the sandbox uid can
    read when we are root (this venv's lives under /root): the system python."""
    found = [pytest.param(("namespaces", None), id="namespaces",
                          marks=pytest.mark.skipif(not NAMESPACES, reason="unshare does not work here"))]
    fallback_python = SYSTEM_PYTHON if os.geteuid() == 0 else None
    found.append(pytest.param(("rlimits", fallback_python), id="rlimits",
                              marks=pytest.mark.skipif(os.geteuid() == 0 and SYSTEM_PYTHON is None,
                                                       reason="no world-readable python for the fallback")))
    return found


@pytest.fixture(params=modes())
def sandbox(request):
    isolation, python = request.param
    return Sandbox(LIMITS, isolation=isolation, **({"python": python} if python else {}))


@pytest.fixture
def short_sandbox(sandbox):
    """The same sandbox with a 1.5 s wall limit, for tests that must run into it."""
    return Sandbox(SHORT, isolation=sandbox.isolation, python=sandbox.python)


def leftover_sandbox_processes():
    """Live processes still running the sandbox's child script (forks of it included)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if CHILD_SCRIPT.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def test_normal_code_runs_with_files_and_a_clean_environment(sandbox):
    result = sandbox.run("import os, helper\nprint(helper.X, sorted(os.environ), os.getcwd() == os.environ['HOME'])",
                         files={"helper.py": "X = 41 + 1\n"})
    assert result.ok and result.returncode == 0
    assert result.stdout == "42 ['HOME', 'LANG', 'PATH', 'PYTHONIOENCODING', 'TMPDIR'] True\n"


def test_network_access_is_blocked(sandbox):
    server = socket.create_server(("127.0.0.1", 0))  # a host service the sandbox must not reach
    port = server.getsockname()[1]
    try:
        result = sandbox.run(f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("example.com", 80)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("CONNECTED", address)
    except Exception as exc:
        print("blocked", type(exc).__name__)
""")
    finally:
        server.close()
    assert "CONNECTED" not in result.stdout + result.stderr
    assert result.stdout.count("blocked") == 3 or "not allowed" in result.stderr


def test_writes_outside_the_sandbox_dir_are_blocked_and_the_host_is_untouched(sandbox, tmp_path):
    target_dir = tmp_path / "open"
    target_dir.mkdir()
    os.chmod(target_dir, 0o777)  # even a world-writable host dir must stay untouched
    os.chmod(tmp_path, 0o755)
    targets = [str(target_dir / "escaped"), "/tmp/agentrl-escape-test", "/dev/shm/agentrl-escape-test",
               os.path.join(os.getcwd(), "agentrl-escape-test")]
    code = f"""
import ast
import os
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("wrote", path)
    except OSError as exc:
        print("blocked", type(exc).__name__)
with open("inside.txt", "w") as f:
    f.write("ok")
print(open("inside.txt").read())
"""
    result = sandbox.run(code)
    assert result.ok and result.stdout.endswith("ok\n")
    for path in targets:
        assert not os.path.exists(path), path
        # In "namespaces" mode /tmp is the sandbox's own tmpfs, so that write succeeds privately.
        if f"wrote {path}" in result.stdout:
            assert sandbox.isolation == "namespaces" and path.startswith("/tmp/")


def test_fork_bomb_is_contained_and_leaves_nothing_behind(short_sandbox):
    start = time.monotonic()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = short_sandbox.run(bomb)
    assert result.outcome in ("timeout", "cpu_limit", "killed") and not result.ok
    assert time.monotonic() - start < SHORT.wall_s + 2
    time.sleep(0.2)
    assert leftover_sandbox_processes() == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_memory_bomb_is_reported(sandbox):
    result = sandbox.run("blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))\n")
    assert result.outcome == "memory_limit" and "MemoryError" in result.stderr


def test_infinite_loop_hits_the_cpu_limit(sandbox):
    start = time.monotonic()
    result = sandbox.run("while True:\n    pass\n")
    assert result.outcome == "cpu_limit" and time.monotonic() - start < LIMITS.wall_s


def test_sleeping_forever_hits_the_wall_limit(short_sandbox):
    result = short_sandbox.run("import time\ntime.sleep(60)\n")
    assert result.outcome == "timeout" and SHORT.wall_s <= result.wall_s < SHORT.wall_s + 1.5


def test_host_environment_variables_are_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("AGENTRL_TEST_SECRET", "hunter2-secret")
    result = sandbox.run(f"""
import ast
import os
print(dict(os.environ))
for path in ["/proc/self/environ", "/proc/1/environ", "/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ"]:
    try:
        print(open(path, "rb").read())
    except OSError as exc:
        print("denied", path)
""")
    assert "hunter2" not in result.stdout + result.stderr and "AGENTRL_TEST_SECRET" not in result.stdout
    assert result.stdout.startswith("{'PATH'")


def test_output_is_truncated(sandbox):
    result = sandbox.run("import sys\nprint('x' * 10**6)\nprint('y' * 10**5, file=sys.stderr)")
    assert result.ok and result.stdout == "x" * 4096 and result.stdout_truncated
    assert result.stderr == "y" * 4096 and result.stderr_truncated


def test_code_errors_are_results_not_sandbox_errors(sandbox):
    result = sandbox.run("def f():\n    raise ValueError('bad input')\nf()\n")
    assert result.outcome == "error" and result.returncode == 1
    assert result.stderr.startswith("Traceback") and 'File "main.py", line 3' in result.stderr
    assert "sandbox_child" not in result.stderr  # the user's traceback, not ours
    assert sandbox.run("import sys\nsys.exit(4)").returncode == 4
    assert sandbox.run("syntax error here").outcome == "error"


@pytest.mark.skipif(not NAMESPACES, reason="unshare does not work here")
def test_namespace_mode_hides_home_dirs_and_host_processes():
    result = Sandbox(LIMITS).run("import os\nprint(os.listdir('/root'), len([p for p in os.listdir('/proc') "
                                 "if p.isdigit()]))")
    listed, count = result.stdout.rsplit(" ", 1)
    assert result.ok and int(count) <= 3  # supervisor and payload only
    assert all(name == ".pyenv" for name in ast.literal_eval(listed))  # only what the interpreter needs


@pytest.mark.skipif(not NAMESPACES, reason="unshare does not work here")
def test_hidden_paths_are_empty_inside():
    with tempfile.TemporaryDirectory(dir="/var/tmp") as data:  # not /tmp: that is the sandbox's own tmpfs
        with open(os.path.join(data, "hidden_tests.json"), "w") as f:
            f.write("secret answers")
        os.chmod(data, 0o755)
        code = f"import os\nprint(os.listdir({data!r}))"
        assert Sandbox(LIMITS).run(code).stdout == "['hidden_tests.json']\n"  # readable unless hidden
        assert Sandbox(LIMITS, hidden_paths=["/root", data]).run(code).stdout == "[]\n"
    with pytest.raises(ValueError, match="hidden_paths"):
        Sandbox(LIMITS, hidden_paths=["relative/dir"])


def test_sandbox_failures_raise_sandbox_error_not_a_code_outcome(tmp_path):
    with pytest.raises(SandboxError, match="start"):
        Sandbox(LIMITS, python=str(tmp_path / "no-such-python")).run("print(1)")
    not_python = tmp_path / "fake-python"
    not_python.write_text("#!/bin/sh\nexit 3\n")
    not_python.chmod(0o755)
    with pytest.raises(SandboxError, match="failed to start"):
        Sandbox(LIMITS, python=str(not_python)).run("print(1)")


def test_a_sandbox_that_cannot_start_in_time_is_a_sandbox_error(tmp_path):
    slow = tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\nsleep 5\n")
    slow.chmod(0o755)
    with pytest.raises(SandboxError, match="did not start within"):
        Sandbox(SandboxLimits(wall_s=0.5), python=str(slow)).run("print(1)")


def test_invalid_limits_and_file_names_name_the_value():
    with pytest.raises(ValueError, match="wall_s.*-1"):
        SandboxLimits(wall_s=-1)
    with pytest.raises(ValueError, match="'../escape.py'"):
        Sandbox(LIMITS).run("", files={"../escape.py": ""})
    with pytest.raises(ValueError, match="'chroot'"):
        Sandbox(LIMITS, isolation="chroot")


UNIX_PROBE = """
import socket
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect({path!r})
    s.sendall(b"escaped")
    print("CONNECTED")
except Exception as exc:
    print("blocked", type(exc).__name__)
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendto(b"escaped", {dgram!r})
    print("SENT")
except Exception as exc:
    print("blocked", type(exc).__name__)
a, b = socket.socketpair()  # a connected stream pair reaches nothing: allowed (asyncio's event loop needs one)
a.sendall(b"x")
print("pair", b.recv(1))
"""


def test_unix_sockets_on_the_host_are_not_reachable(sandbox):
    """A read-only mount does not stop connect() to a listener on the host's filesystem (issue 27): path sockets,
    stream and datagram, are refused; an anonymous connected pair still works."""
    host_dir = tempfile.mkdtemp(dir="/var/tmp")  # outside the sandbox's private /tmp, readable from inside
    os.chmod(host_dir, 0o777)
    stream_path, dgram_path = os.path.join(host_dir, "listener"), os.path.join(host_dir, "dgram")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(stream_path)
    listener.listen()
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(dgram_path)
    for path in (stream_path, dgram_path):
        os.chmod(path, 0o777)
    try:
        result = sandbox.run(UNIX_PROBE.format(path=stream_path, dgram=dgram_path))
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
        dgram.settimeout(0.2)
        with pytest.raises(TimeoutError):
            dgram.recv(64)
    finally:
        listener.close()
        dgram.close()
        shutil.rmtree(host_dir)
    assert "CONNECTED" not in result.stdout and "SENT" not in result.stdout, result.stdout + result.stderr
    if sandbox.isolation == "namespaces":
        assert result.stdout.count("blocked PermissionError") == 2 and "pair b'x'" in result.stdout, result
    else:  # the audit hook of the fallback refuses every socket
        assert "not allowed" in result.stdout + result.stderr


FORK_AND_HOLD = """
import os, time
for _ in range({children}):
    if os.fork() == 0:
        block = b"x" * (100 << 20)  # written, so resident
        time.sleep(6)
        os._exit(0)
time.sleep({parent_s})
print("done")
"""


def test_memory_is_capped_for_the_run_not_only_per_process(sandbox):
    """Each child stays under the per-process limit (memory_mb); together they go over the run's (issue 27)."""
    limits = SandboxLimits(wall_s=8.0, cpu_s=4.0, memory_mb=256, run_memory_mb=400, max_processes=16)
    box = Sandbox(limits, isolation=sandbox.isolation, python=sandbox.python)
    many = box.run(FORK_AND_HOLD.format(children=6, parent_s=5))
    assert many.outcome == "memory_limit" and many.wall_s < 4.0, many
    assert "over run_memory_mb=400" in many.stderr
    deadline = time.monotonic() + 2  # SIGKILLed processes take a moment to release 100 MiB each
    while leftover_sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_sandbox_processes() == []
    few = box.run(FORK_AND_HOLD.format(children=2, parent_s=1))
    assert few.ok and few.stdout == "done\n", few
