"""The process that runs inside the sandbox (started by ``agentrl.envs.sandbox``; not imported by anything).

It runs as ``python -I -S -B sandbox_child.py`` with a clean environment and reads its configuration as JSON on
stdin, so it may use the standard library only. It has two roles:

* **supervisor** (the first process; PID 1 of a fresh PID namespace in "namespaces" mode): makes the filesystem
  read-only except for a private tmpfs work directory, hides the home directories, writes the input files, forks
  the payload, waits for it and reports its exit status on the report pipe. When it exits, the kernel kills
  everything left in the PID namespace, so a fork bomb cannot outlive the run.
* **payload** (its child): drops to an unprivileged uid when started as root, applies the rlimits, installs the
  audit-hook guard in "rlimits" mode, reports ``ready`` and runs ``main.py``.

The ``ready`` line is what lets the host tell a sandbox that failed to start (an infrastructure failure) from code
that failed inside a working sandbox (the model's fault).
"""

import builtins
import ctypes
import json
import os
import re
import resource
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
# Flags a bind remount must repeat: inside a user namespace the kernel refuses to clear locked ones.
_KEPT_FLAGS = {
    "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME,
}
_BOOTSTRAP_FAILED = 125  # exit status of a supervisor that could not set the sandbox up


def _mount(libc, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def _mount_points():
    """(mount point, per-mount options) from /proc/self/mountinfo, paths unescaped."""
    unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)  # noqa: E731
    with open("/proc/self/mountinfo") as f:
        return [(unescape(line.split(" ")[4]), line.split(" ")[5]) for line in f]


def isolate_filesystem(config):
    """Private tmpfs at the work dir, home directories hidden, every other mount read-only."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    workdir, uid = config["workdir"], config["uid"]
    # The interpreter may live under a hidden home (pyenv in /root): keep a handle on it before hiding, then
    # bind it back at the same path so the payload can still import the standard library.
    keep = [(path, os.open(path, os.O_PATH)) for path in config["keep"]]
    for hidden in config["hide"]:
        if os.path.isdir(hidden) and not workdir.startswith(hidden.rstrip("/") + "/"):
            _mount(libc, "tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, fd in keep:
        os.makedirs(path, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    _mount(libc, "tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk_mb']}m,mode=0700{owner}")
    for point, options in _mount_points():
        if point == workdir:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name in options.split(","):
            flags |= _KEPT_FLAGS.get(name, 0)
        try:
            _mount(libc, None, point, None, flags)
        except FileNotFoundError:
            continue  # a mount now covered by a hidden directory or the work tmpfs: unreachable anyway


def write_files(workdir, files, uid):
    for name, text in files.items():
        path = os.path.join(workdir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if uid is not None:
            os.chown(path, uid, uid)


def set_limits(limits):
    cpu = int(limits["cpu_s"] + 0.999)
    # The soft CPU limit sends SIGXCPU; the hard one, a second later, SIGKILLs code that catches SIGXCPU.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["disk_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)


def install_guard(workdir, supervisor_pid):
    """The "rlimits" fallback's audit hook: no sockets, no writes outside the work dir, no new programs.

    Best effort only: it stops honest mistakes and casual escapes by Python code, not a determined attacker (C
    extensions and ctypes are blocked, but a hook is not a kernel boundary). "namespaces" mode does not need it.
    """
    root = os.path.realpath(workdir) + os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    blocked = {
        "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen", "os.system",
        "os.exec", "os.posix_spawn", "os.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.putenv",
    }
    path_events = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime", "shutil.rmtree"}
    own_environ = re.compile(rf"/proc/(self|{os.getpid()})/")

    def inside(path):
        if isinstance(path, int):
            return True  # an fd: it was opened through this hook already
        path = os.fsdecode(path)
        return path == os.devnull or (os.path.realpath(path) + os.sep).startswith(root)

    def deny(event, detail):
        raise PermissionError(f"sandbox: {event} {detail!r} is not allowed")

    def hook(event, args):
        if event in blocked:
            deny(event, args[:1])
        elif event == "import" and args[0] in ("_posixsubprocess", "_ctypes", "_socket"):
            deny(event, args[0])
        elif event == "open":
            path, flags = args[0], args[2]
            if isinstance(path, (str, bytes)) and os.fsdecode(path).startswith("/proc/") \
                    and not own_environ.match(os.fsdecode(path)):
                deny(event, path)  # other processes' environ and memory
            if flags & write_flags and not inside(path):
                deny(event, path)
        elif event in path_events:
            for path in args[:2]:
                if isinstance(path, (str, bytes, int)) and not inside(path):
                    deny(event, path)
        elif event in ("os.kill", "os.killpg") and args[0] in (supervisor_pid, 0, -1):
            deny(event, args[0])

    sys.addaudithook(hook)


# seccomp: the payload may not create Unix-domain sockets. A network namespace covers inet and abstract sockets but not
# path sockets: a read-only mount does not stop connect() to a listener anywhere on the host's filesystem. Connected
# stream/seqpacket socketpairs stay allowed (asyncio's self-pipe needs one; neither end can address a path); datagram
# ones are refused, since sendto() on them can name a path.
AF_UNIX, SOCK_DGRAM, SOCK_TYPE_MASK = 1, 2, 0xF
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# (AUDIT_ARCH, socket, socketpair, first number of another ABI sharing the arch or None) per machine
_SYSCALLS = {"x86_64": (0xC000003E, 41, 53, 0x40000000), "aarch64": (0xC00000B7, 198, 199, None)}
_LD_ABS, _JEQ, _JGE, _AND, _RET = 0x20, 0x15, 0x35, 0x54, 0x06


def _socket_filter(machine):
    """The BPF program (code, jt, jf, k): seccomp_data is nr at 0, arch at 4, args from 16 (low words first)."""
    arch, nr_socket, nr_pair, other_abi = _SYSCALLS[machine]
    deny, allow = (_RET, 0, 0, SECCOMP_RET_ERRNO | EPERM), (_RET, 0, 0, SECCOMP_RET_ALLOW)
    prog = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, arch), deny, (_LD_ABS, 0, 0, 0)]
    if other_abi is not None:  # x32 calls on x86_64 carry the same arch with this bit set
        prog += [(_JGE, 0, 1, other_abi), deny]
    prog += [(_JEQ, 2, 0, nr_socket), (_JEQ, 5, 0, nr_pair), allow,
             (_LD_ABS, 0, 0, 16), (_JEQ, 0, 1, AF_UNIX), deny, allow,  # socket(AF_UNIX, ...)
             (_LD_ABS, 0, 0, 16), (_JEQ, 0, 4, AF_UNIX), (_LD_ABS, 0, 0, 24), (_AND, 0, 0, SOCK_TYPE_MASK),
             (_JEQ, 0, 1, SOCK_DGRAM), deny, allow]  # socketpair(AF_UNIX, SOCK_DGRAM, ...)
    return prog


def block_unix_sockets():
    """Installs the filter for this process and everything it starts; OSError where the kernel refuses it."""
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise OSError(f"no seccomp filter for {machine}: Unix sockets cannot be blocked")

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    program = _socket_filter(machine)
    filters = (SockFilter * len(program))(*[SockFilter(*insn) for insn in program])
    fprog = SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.cast(ctypes.pointer(fprog), ctypes.c_void_p),
                       0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"seccomp filter refused: {os.strerror(errno)}")


def run_payload(config, report_fd, supervisor_pid):
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    set_limits(config["limits"])
    uid = config["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    stdlib = os.path.dirname(os.__file__)
    if not os.access(stdlib, os.R_OK | os.X_OK):
        # Imports would fail and look like the code's fault; it is the host's (python under a private home).
        raise PermissionError(f"the sandbox uid cannot read the standard library at {stdlib}: install Python "
                              "somewhere world-readable, or run where namespaces are available")
    block_unix_sockets()  # after setuid (no_new_privs would not stop it) and before any of the code runs
    os.chdir(config["workdir"])
    os.umask(0o077)
    sys.path.insert(0, config["workdir"])
    if config["guard"]:
        install_guard(config["workdir"], supervisor_pid)
    entry = config["entry"]
    with open(entry, encoding="utf-8") as f:
        source = f.read()
    os.write(report_fd, b"ready\n")
    os.close(report_fd)
    try:
        # Compiled after "ready": a syntax error is the code's fault, not the sandbox's.
        exec(compile(source, entry, "exec"), {"__name__": "__main__", "__file__": entry, "__builtins__": builtins})
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - print the user's traceback without this frame, like python does
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.stderr.flush()
        os._exit(1)


def main():
    config = json.loads(sys.stdin.buffer.read())
    report_fd = config["report_fd"]
    try:
        if config["mode"] == "namespaces":
            isolate_filesystem(config)
        write_files(config["workdir"], config["files"], config["uid"])
    except Exception as exc:  # noqa: BLE001 - any setup failure is the sandbox's, reported as such
        os.write(report_fd, f"setup-failed {exc!r}\n".encode())
        sys.exit(_BOOTSTRAP_FAILED)
    supervisor_pid = os.getpid()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        # The payload leaves through ordinary interpreter exit (sys.exit codes, thread joins, flushing) as if
        # main.py had been run by python; an error before "ready" exits non-zero and the host sees no "ready".
        run_payload(config, report_fd, supervisor_pid)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    os.write(report_fd, f"exit {returncode}\n".encode())
    sys.exit(returncode if returncode >= 0 else 128 - returncode)


if __name__ == "__main__":
    main()
