"""The worker process that runs agent code (see worker.py for the layers of isolation).

Standard library only: it is started as `python -I -S` with this folder alone on sys.path, so it
imports nothing of agentrl, nothing from site-packages, and reads no environment.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

MAX_CALLS_PER_STEP = 300


@dataclass(frozen=True)
class Limits:
    cpu_time_s: float = 2.0
    memory_mb: int = 256
    output_chars: int = 4000
    wall_timeout_s: float = 5.0


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

    def recv(self):
        return json.loads(self.conn.recv_bytes())

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def _worker_main(conn, limits: Limits) -> None:  # pragma: no cover - runs in the child
    os.chdir("/")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
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

    def fresh_namespace():
        return {"__builtins__": safe, "apis": _Apis(), "ApiError": ApiError}

    ns = fresh_namespace()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "reset":
            ns = fresh_namespace()
            conn.send(("done", True, "", ""))
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
            exec(compile(code, "<agent>", "exec"), ns)  # noqa: S102 - checked by policy.py, limited by the OS
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


def main() -> None:  # pragma: no cover - the worker process entry point
    fd, cpu, mem, out, wall = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    _worker_main(_JsonConn(Connection(fd)), Limits(cpu, mem, out, wall))




if __name__ == "__main__":  # pragma: no cover
    main()
