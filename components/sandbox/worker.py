"""Agent code runs here: a separate worker process behind two walls.

Written by hand because no maintained library runs untrusted Python with a callback channel to a
stateful environment. The first wall is the AST policy (safety.py), checked before anything is sent. The second
is the OS: a template interpreter (`python -I -S`, no environment, a private directory) enters a network
namespace of its own, drops to uid nobody and sets RLIMIT_FSIZE/NOFILE/CORE; it forks one worker per episode,
which adds RLIMIT_NPROC=0, RLIMIT_AS, RLIMIT_CPU and a seccomp filter (no exec, fork, socket, namespace, kill,
ptrace, file creation or opening for writing). Restricted builtins, a bounded print, a cap on API calls per step
and a wall-clock timeout (the parent kills the worker) come on top. The only object the code can reach is the
`apis` proxy, whose calls travel back over a socket (JSON frames, bounded in size and time) to the environment
in the parent process; the world never enters the worker. With the policy bypassed the OS walls alone hold
(tests/sandbox/test_isolation.py, 41 attempts).
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from components.sandbox.worker_entry import MAX_MESSAGE_BYTES, NOBODY, Limits

__all__ = ["CodeResult", "CodeRunner", "Limits", "WorkerStartError"]
log = logging.getLogger(__name__)


class WorkerStartError(RuntimeError):
    pass


@dataclass
class CodeResult:
    ok: bool
    stdout: str = ""
    error: str = ""
    value: Any = None
    calls: list[tuple[str, dict]] = field(default_factory=list)
    crashed: bool = False


# ----------------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------------


class _Channel:
    """The parent's end of the worker channel: multiprocessing.Connection's framing (a 4-byte big-endian length,
    then JSON), read with a deadline and a size bound, so a worker that forges or truncates a frame cannot make the
    parent wait (Connection.recv_bytes would block on a length that never arrives)."""

    READ_TIMEOUT_S = 5.0

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, obj) -> None:
        data = json.dumps(obj, default=str).encode()
        self.sock.settimeout(self.READ_TIMEOUT_S)
        self.sock.sendall(struct.pack("!i", len(data)) + data)

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the worker channel closed")
            buf += chunk
        return bytes(buf)

    def recv(self, maxlength: int = MAX_MESSAGE_BYTES):
        self.sock.settimeout(self.READ_TIMEOUT_S)  # a frame that has begun must end soon
        (size,) = struct.unpack("!i", self._exactly(4))
        if size < 0 or size > maxlength:
            raise ValueError(f"bad message length {size}")
        return json.loads(self._exactly(size))

    def poll(self, timeout: float) -> bool:
        return bool(select.select([self.sock], [], [], max(0.0, timeout))[0])

    def close(self) -> None:
        self.sock.close()


class CodeRunner:
    """A template process (behind the network, uid and file walls) that forks one worker per episode (which adds the
    process limit and the seccomp filter); a worker lost to a crash, a timeout or a limit is replaced transparently,
    a lost template too."""

    _warned = False

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.proc = None  # the template
        self.conn = None
        self.child: int | None = None  # the worker's pid
        self.workdir: str | None = None
        self.walls: dict[str, Any] = {}  # which OS walls the worker raised (True) or why not
        self.restarts = 0

    def _start(self) -> None:
        # a fresh interpreter (not a fork of a process holding torch threads or the world), `-I -S`:
        # isolated mode, no site-packages, no environment at all, a private working directory
        parent, child = socket.socketpair()
        lim = self.limits
        self.workdir = tempfile.mkdtemp(prefix="agentrl-worker-")
        if os.getuid() == 0:  # the worker drops to nobody: its directory is its own
            os.chown(self.workdir, NOBODY, NOBODY)
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c",
             "import sys; sys.path.insert(0, sys.argv.pop(1)); from worker_entry import main; main()",
             os.path.dirname(os.path.abspath(__file__)),
             str(child.fileno()), str(lim.cpu_time_s), str(lim.memory_mb), str(lim.output_chars), str(lim.wall_timeout_s),
             lim.isolation, self.workdir],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env={}, cwd=self.workdir,
        )
        child.close()
        self.conn = _Channel(parent)

    def _fork(self) -> None:
        """A new worker from the template (the template is started first when there is none)."""
        if self.proc is None or self.proc.poll() is not None:
            self._kill()
            self._start()
        self.conn.send(("fork",))
        if not self.conn.poll(max(self.limits.wall_timeout_s, 10.0)):
            self._kill()
            raise WorkerStartError("code worker: no answer from the template")
        msg = self.conn.recv(MAX_MESSAGE_BYTES)
        if msg[0] != "ready":
            self._kill()
            raise WorkerStartError(f"code worker: ended before it started ({msg})")
        _, walls, self.child = msg
        self.walls = walls
        missing = {k: v for k, v in walls.items() if v is not True}
        if missing and self.limits.isolation == "strict":
            self._kill()
            raise WorkerStartError(
                "code worker: OS isolation unavailable here (" + "; ".join(f"{k}: {v}" for k, v in missing.items())
                + "); sandbox.code_isolation=auto runs with the walls that are up (README, 'Code actions')")
        if missing and not CodeRunner._warned:
            CodeRunner._warned = True
            log.warning("code worker runs without: %s (sandbox.code_isolation=auto)", missing)

    def _end_worker(self, kill: bool = False) -> int | None:
        """Stop (or kill) the worker; returns how it ended as the template saw it, None when unknown."""
        if self.child is None:
            return None
        pid, self.child = self.child, None
        try:
            if kill:
                os.kill(pid, signal.SIGKILL)
            else:
                self.conn.send(("stop",))
            # the template reports the end; anything else the worker still had in flight is skipped
            deadline = time.monotonic() + 5.0
            while self.conn.poll(max(0.0, deadline - time.monotonic())):
                msg = self.conn.recv(MAX_MESSAGE_BYTES)
                if isinstance(msg, list) and msg and msg[0] == "exited":
                    return msg[1]
        except (OSError, EOFError, ValueError, TypeError):
            pass
        self._kill()  # the template did not answer: start over
        return None

    def _kill(self) -> None:
        if self.child is not None:
            try:
                os.kill(self.child, signal.SIGKILL)
            except OSError:
                pass
            self.child = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.conn is not None:
            self.conn.close()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.proc = self.conn = self.workdir = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.child is not None

    def reset(self) -> None:
        """A fresh worker (between episodes): no Python state of one episode, e.g. an attribute set on a shared
        class, reaches the next."""
        self._end_worker()
        self._fork()

    def run(self, code: str, handler) -> CodeResult:
        """Execute `code`; `handler(tool, args, kwargs) -> (ok, value | (code, message))` serves API calls."""
        if not self.alive():
            self._end_worker(kill=True)
            self._fork()
        result = CodeResult(ok=False)
        deadline = time.monotonic() + self.limits.wall_timeout_s
        try:
            self.conn.send(("exec", code))
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.conn.poll(remaining):
                    self._end_worker(kill=True)
                    self.restarts += 1
                    result.error = f"TimeoutError: wall-clock limit of {self.limits.wall_timeout_s:g} s reached"
                    result.crashed = True
                    return result
                msg = self.conn.recv(MAX_MESSAGE_BYTES)
                if not isinstance(msg, list) or not msg:
                    raise ValueError("not a worker message")
                if msg[0] == "exited":  # the template: the worker died (a limit, a signal)
                    self.child = None
                    return self._crashed(result, msg[1])
                if msg[0] == "call":
                    _, tool, args, kwargs = msg
                    ok, payload = handler(tool, args, kwargs)
                    result.calls.append((tool, kwargs))
                    self.conn.send(("ret", ok, payload))
                    continue
                _, ok, stdout, err = msg
                result.ok, result.stdout, result.error = ok, stdout, err
                return result
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError, ValueError, TypeError) as exc:
            forged = isinstance(exc, (ValueError, TypeError, TimeoutError))
            if forged:
                self._end_worker(kill=True)
                self.restarts += 1
                result.error, result.crashed = "WorkerError: sent a message outside the protocol", True
                return result
            self._kill()
            return self._crashed(result, None)

    def request(self, msg: tuple) -> tuple[bool, Any, str]:
        """One request to a file-defined environment's tool module in the worker (`worker_entry._tool_request`):
        (ok, value, error). A timeout, a crash or a forged answer is an error; the worker is replaced (its state is
        lost: the environment ends the episode)."""
        if not self.alive():
            self._end_worker(kill=True)
            self._fork()
        deadline = time.monotonic() + self.limits.wall_timeout_s
        try:
            self.conn.send(msg)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.conn.poll(remaining):
                self._end_worker(kill=True)
                self.restarts += 1
                return False, None, f"TimeoutError: wall-clock limit of {self.limits.wall_timeout_s:g} s reached"
            answer = self.conn.recv(MAX_MESSAGE_BYTES)
            if isinstance(answer, list) and answer and answer[0] == "exited":
                self.child = None
                return False, None, self._crashed(CodeResult(ok=False), answer[1]).error
            kind, ok, value, err = answer
            if kind != "value":
                raise ValueError("not a tool answer")
            return bool(ok), value, str(err)
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError, ValueError, TypeError):
            self._end_worker(kill=True)
            self.restarts += 1
            return False, None, "WorkerError: the tool worker failed"

    def _crashed(self, result: CodeResult, code: int | None) -> CodeResult:
        self.restarts += 1
        why = {-24: "CPU time limit reached (SIGXCPU)", -9: "killed (memory or CPU limit)",
               -11: "crashed (SIGSEGV)"}.get(code, f"worker exited with {code}")
        result.error = f"WorkerError: {why}"
        result.crashed = True
        return result

    def close(self) -> None:
        self._kill()

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
