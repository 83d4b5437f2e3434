"""The worker process that runs agent code (see worker.py for the layers of isolation).

Standard library only: it is started as `python -I -S` with this folder alone on sys.path, so it
imports nothing of agentrl, nothing from site-packages, and reads no environment.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

MAX_CALLS_PER_STEP = 300
# what a file-defined environment's tool module may import (loaded by the template before the walls go up)
TOOL_MODULES = ("json", "re", "math", "copy", "datetime", "collections", "itertools", "functools", "string")
MAX_MESSAGE_BYTES = 4 << 20  # one message from the worker: an API call's arguments or a step's output


@dataclass(frozen=True)
class Limits:
    cpu_time_s: float = 2.0
    memory_mb: int = 256
    output_chars: int = 4000
    wall_timeout_s: float = 5.0
    isolation: str = "auto"  # 'strict': a worker without every OS wall refuses to start; 'auto': it reports them


# ----------------------------------------------------------------------------------------------
# The OS walls (the AST policy is the other one): no network, an unprivileged uid, no new processes, no file
# writes, few descriptors, a seccomp filter. Done with ctypes (standard library): the worker imports nothing else.
# ----------------------------------------------------------------------------------------------
NOBODY = 65534
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7
_EPERM = 1
# syscalls agent code never needs once the worker runs: processes, sockets, namespaces, file changes, tracing
DENIED_SYSCALLS = (
    "execve", "execveat", "fork", "vfork", "clone", "clone3", "ptrace", "process_vm_readv", "process_vm_writev",
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "kill", "tkill", "tgkill",
    "creat", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
    "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat", "truncate",
    "ftruncate", "openat2", "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "personality",
    "io_uring_setup", "userfaultfd", "memfd_create",
)
_O_WRITE_FLAGS = (0o1, 0o2, 0o100, 0o1000, 0o2000)  # O_WRONLY, O_RDWR, O_CREAT, O_TRUNC, O_APPEND


class _ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _seccomp() -> None:
    """Load a filter that answers EPERM to DENIED_SYSCALLS and to opening a file for writing."""
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    deny = 0x00050000 | _EPERM  # SCMP_ACT_ERRNO(EPERM)
    try:
        for name in DENIED_SYSCALLS:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr >= 0 and lib.seccomp_rule_add_array(ctx, deny, nr, 0, None) != 0:
                raise OSError(f"seccomp rule for {name} refused")
        for name, flags_arg in (("open", 1), ("openat", 2)):
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue
            for flag in _O_WRITE_FLAGS:
                cmp = _ArgCmp(flags_arg, _SCMP_CMP_MASKED_EQ, flag, flag)
                if lib.seccomp_rule_add_array(ctx, deny, nr, 1, ctypes.byref(cmp)) != 0:
                    raise OSError(f"seccomp rule for {name} with flag {flag:o} refused")
        if lib.seccomp_load(ctx) != 0:
            raise OSError("seccomp_load failed")
    finally:
        lib.seccomp_release(ctx)


def _isolate_template(keep_fds: int) -> dict:
    """The walls of the template process (it forks one worker per episode, so no seccomp or process limit yet):
    its own network namespace, an unprivileged uid, no file writes, few descriptors. Returns which walls are up
    ({'network': True, ...}), with the reason for any that is not. Namespaces need the privileges the uid drop
    gives away, so they come first."""
    libc = ctypes.CDLL(None, use_errno=True)
    up: dict = {}
    root = os.getuid() == 0
    # network: a namespace of its own, whose only interface (lo) is down: no route anywhere, not even the host
    flags = CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET
    up["network"] = libc.unshare(flags) == 0 or f"unshare: {os.strerror(ctypes.get_errno())}"
    # an unprivileged uid (as root; an unprivileged caller is unmapped, i.e. nobody, in its user namespace)
    try:
        if root:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        up["uid"] = os.getuid() != 0 or "still root"
    except OSError as exc:
        up["uid"] = f"setuid: {exc}"
    up.update(_limit((("files", resource.RLIMIT_NOFILE, keep_fds), ("file_size", resource.RLIMIT_FSIZE, 0),
                      ("core", resource.RLIMIT_CORE, 0))))
    return up


def _isolate_worker() -> dict:
    """The walls a forked worker adds before it runs any agent code: no new process, the seccomp filter."""
    up = _limit((("processes", resource.RLIMIT_NPROC, 0),))
    try:
        _seccomp()
        up["seccomp"] = True
    except OSError as exc:
        up["seccomp"] = f"libseccomp: {exc}"
    return up


def _limit(limits) -> dict:
    up = {}
    for name, res, value in limits:
        try:
            resource.setrlimit(res, (value, value))
            up[name] = True
        except (ValueError, OSError) as exc:
            up[name] = f"setrlimit: {exc}"
    return up


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------
class ApiError(Exception):
    """Raised inside agent code when an API call fails; `code` is HTTP-like (404, 429, 503, ...)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class _OutputLimit(BaseException):
    pass


class _JsonConn:
    """Messages as JSON (never pickle: the worker is untrusted, the parent must not unpickle its bytes)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, obj) -> None:
        self.conn.send_bytes(json.dumps(obj, default=str).encode())

    def recv(self, maxlength: int | None = None):
        # maxlength: the parent reads a worker's message only up to a bound (a forged length header would
        # otherwise make it wait for gigabytes that never come)
        return json.loads(self.conn.recv_bytes(maxlength))

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def _template_main(conn, limits: Limits, workdir: str) -> None:  # pragma: no cover - runs in the template
    """A clean interpreter behind the template walls that forks one worker per episode (a fork costs about a
    millisecond, a fresh interpreter about fifty): no Python state of one episode reaches the next. While a worker
    runs, the template waits for it and then reports how it ended: ("exited", code; -N = killed by signal N)."""
    os.chdir(workdir)
    for name in TOOL_MODULES:
        __import__(name)
    walls = _isolate_template(keep_fds=32)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "fork":
            return
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                up = {**walls, **_isolate_worker()}
                conn.send(("ready", up, os.getpid()))
                if limits.isolation != "strict" or all(v is True for v in up.values()):
                    _worker_main(conn, limits)
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        try:
            conn.send(("exited", code))
        except OSError:
            return


def _worker_main(conn, limits: Limits) -> None:  # pragma: no cover - runs in the forked worker
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mem = max(base, 64 << 20) + limits.memory_mb * (1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (mem * 2, mem * 2))
    except (ValueError, OSError):
        pass
    sys.setrecursionlimit(300)

    out: list[str] = []
    size = [0]
    calls = [0]

    def _print(*args, sep=" ", end="\n"):
        text = sep.join(str(a) for a in args) + end
        if size[0] + len(text) > limits.output_chars:
            out.append(text[: max(0, limits.output_chars - size[0])])
            size[0] = limits.output_chars
            raise _OutputLimit()
        out.append(text)
        size[0] += len(text)

    class _Op:
        __slots__ = ("_tool",)

        def __init__(self, tool):
            self._tool = tool

        def __call__(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] > MAX_CALLS_PER_STEP:
                raise ApiError(429, f"more than {MAX_CALLS_PER_STEP} API calls in one step")
            conn.send(["call", self._tool, list(args), kwargs])
            kind, ok, payload = conn.recv()
            if ok:
                return payload
            raise ApiError(payload[0], payload[1])

    class _App:
        __slots__ = ("_app",)

        def __init__(self, app):
            self._app = app

        def __getattr__(self, op):
            return _Op(f"{self._app}.{op}")

    class _Apis:
        __slots__ = ()

        def __getattr__(self, name):
            if name in ("ask_user", "finish"):
                return _Op(name)
            return _App(name)

    import builtins

    safe = {n: getattr(builtins, n) for n in (
        "abs", "all", "any", "bool", "dict", "enumerate", "filter", "float", "int", "isinstance", "len", "list",
        "map", "max", "min", "range", "reversed", "round", "set", "sorted", "str", "sum", "tuple", "zip",
        "Exception", "ValueError", "KeyError", "IndexError", "TypeError", "RuntimeError", "ZeroDivisionError",
        "True", "False", "None",
    )}
    safe["print"] = _print
    safe["ApiError"] = ApiError

    ns = {"__builtins__": safe, "apis": _Apis(), "ApiError": ApiError}
    tools: dict = {}  # a file-defined environment's tool module: its namespace, the episode's state and task

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if level or name.split(".")[0] not in TOOL_MODULES:
            raise ImportError(f"the tool module may import only {', '.join(TOOL_MODULES)} (not {name!r})")
        return __import__(name, globals, locals, fromlist, level)

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind in ("load", "tool"):
            _tool_request(conn, msg, tools, {**safe, "__import__": _import, "object": object, "type": type,
                                             "getattr": getattr, "hasattr": hasattr, "repr": repr}, limits)
            continue
        code = msg[1]
        out.clear()
        size[0] = 0
        calls[0] = 0
        used = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime
        soft = int(used + limits.cpu_time_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
        err = ""
        ok = True
        try:
            exec(compile(code, "<agent>", "exec"), ns)  # noqa: S102 - checked by safety.py, limited by the OS
        except _OutputLimit:
            err = f"output limit of {limits.output_chars} characters reached"
            ok = False
        except ApiError as exc:
            err = f"ApiError {exc.code}: {exc.message}"
            ok = False
        except RecursionError:
            err = "RecursionError: maximum recursion depth exceeded"
            ok = False
        except MemoryError:
            err = f"MemoryError: memory limit of {limits.memory_mb} MB reached"
            ok = False
        except BaseException as exc:  # noqa: BLE001 - anything the agent's code raises is an observation
            err = f"{type(exc).__name__}: {str(exc)[:300]}"
            ok = False
        try:
            conn.send(("done", ok, "".join(out), err))
        except (BrokenPipeError, OSError):
            return


def _tool_request(conn, msg, tools: dict, builtins_: dict, limits) -> None:  # pragma: no cover - in the worker
    """A file-defined environment's request: ("load", source, task) runs the tool module and its `init(task)`;
    ("tool", name, kwargs) calls `name(state, **kwargs)`, or the module's `check(state, task)` / `user_turn(state,
    task)` for the names '__check__' / '__user_turn__'; '__finish__' keeps the agent's last reply as
    task["final_answer"]. Answers ("value", ok, result, error)."""
    used = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime
    resource.setrlimit(resource.RLIMIT_CPU, (int(used + limits.cpu_time_s) + 1, resource.RLIM_INFINITY))
    ok, value, err = True, None, ""
    try:
        if msg[0] == "load":
            ns = {"__builtins__": builtins_, "__name__": "agentrl_tools"}
            exec(compile(msg[1], "tools.py", "exec"), ns)  # noqa: S102 - the user's module, behind the OS walls
            tools.clear()
            tools.update(ns=ns, task=msg[2])
            tools["state"] = ns["init"](msg[2]) if callable(ns.get("init")) else {}
        else:
            name, kwargs = msg[1], msg[2]
            ns = tools.get("ns", {})
            if name == "__finish__":  # the agent's reply that ended its turn: check() reads task["final_answer"]
                tools["task"]["final_answer"] = str(kwargs.get("answer", ""))
            elif name in ("__check__", "__user_turn__"):
                f = ns.get(name.strip("_"))
                value = f(tools["state"], tools["task"]) if callable(f) else None
            elif name.startswith("_") or not callable(ns.get(name)):
                raise KeyError(f"the tool module defines no tool {name!r}")
            else:
                value = ns[name](tools["state"], **kwargs)
            json.dumps(value)  # the answer must be JSON: say so here rather than in the parent
    except MemoryError:
        ok, err = False, f"MemoryError: memory limit of {limits.memory_mb} MB reached"
    except BaseException as exc:  # noqa: BLE001 - a tool's failure is the agent's observation
        ok, err = False, f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        conn.send(("value", ok, value if ok else None, err))
    except (BrokenPipeError, OSError):
        return


def main() -> None:  # pragma: no cover - the worker process entry point
    fd, cpu, mem, out, wall = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    isolation, workdir = sys.argv[6], sys.argv[7]
    _template_main(_JsonConn(Connection(fd)), Limits(cpu, mem, out, wall, isolation), workdir)




if __name__ == "__main__":  # pragma: no cover
    main()
