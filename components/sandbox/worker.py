"""Agent code runs here: a separate worker process with restricted builtins and OS limits.

Written by hand because no maintained library runs untrusted Python with a callback channel to a
stateful environment; the layers are: the AST policy (policy.py) before anything is sent, restricted
builtins and no importable modules in the worker, RLIMIT_AS (memory), RLIMIT_CPU (CPU time per
step, SIGXCPU kills the worker), RLIMIT_FSIZE=0 (no file writes), a bounded print, a cap on API calls
per step, and a wall-clock timeout enforced by the parent, which kills and replaces the worker. The
only object the code can reach is the `apis` proxy, whose calls travel back over a pipe to the
environment in the parent process; the world itself never enters the worker, so the environment
survives anything the worker does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from components.sandbox.worker_entry import Limits, _JsonConn

__all__ = ["CodeResult", "CodeRunner", "Limits"]


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


class CodeRunner:
    """One worker process; restarted transparently after a crash, a timeout or a limit kill."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.proc = None
        self.conn = None
        self.restarts = 0

    def _start(self) -> None:
        # a fresh interpreter (not a fork of a process holding torch threads or the world), `-I -S`:
        # isolated mode, no site-packages, no user environment
        parent, child = socket.socketpair()
        lim = self.limits
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c",
             "import sys; sys.path.insert(0, sys.argv.pop(1)); from worker_entry import main; main()",
             os.path.dirname(os.path.abspath(__file__)),
             str(child.fileno()), str(lim.cpu_time_s), str(lim.memory_mb), str(lim.output_chars), str(lim.wall_timeout_s)],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"}, cwd="/",
        )
        child.close()
        self.conn = _JsonConn(Connection(parent.detach()))

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reset(self) -> None:
        """A fresh namespace (between episodes)."""
        if not self.alive():
            self._kill()
            self._start()
            return
        self.conn.send(("reset",))
        if not self.conn.poll(self.limits.wall_timeout_s):
            self._kill()
            self._start()
            return
        self.conn.recv()

    def run(self, code: str, handler) -> CodeResult:
        """Execute `code`; `handler(tool, args, kwargs) -> (ok, value | (code, message))` serves API calls."""
        if not self.alive():
            self._kill()
            self._start()
        result = CodeResult(ok=False)
        deadline = time.monotonic() + self.limits.wall_timeout_s
        try:
            self.conn.send(("exec", code))
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.conn.poll(remaining):
                    self._kill()
                    self.restarts += 1
                    result.error = f"TimeoutError: wall-clock limit of {self.limits.wall_timeout_s:g} s reached"
                    result.crashed = True
                    return result
                msg = self.conn.recv()
                if msg[0] == "call":
                    _, tool, args, kwargs = msg
                    ok, payload = handler(tool, args, kwargs)
                    result.calls.append((tool, kwargs))
                    self.conn.send(("ret", ok, payload))
                    continue
                _, ok, stdout, err = msg
                result.ok, result.stdout, result.error = ok, stdout, err
                return result
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError, ValueError):
            code_ = None
            if self.proc is not None:
                try:
                    code_ = self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    code_ = None
            self._kill()
            self.restarts += 1
            why = {-24: "CPU time limit reached (SIGXCPU)", -9: "killed (memory or CPU limit)",
                   -11: "crashed (SIGSEGV)"}.get(code_, f"worker exited with {code_}")
            result.error = f"WorkerError: {why}"
            result.crashed = True
            return result

    def close(self) -> None:
        if self.alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
        self._kill()

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
