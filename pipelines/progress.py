"""`agentrl run`'s console: kfp.local prints every executor's input JSON and each component's own output (hundreds
of lines); those go to a log file under AGENTRL_HOME, and the console gets one line per task as it finishes (task,
status, elapsed, its key held-out number). `--verbose` streams everything as before.

Written here because kfp.local has no quiet mode: its subprocesses inherit the parent's stdout/stderr, so the
redirection is at the file-descriptor level and a thread follows the log for kfp.local's task messages.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
START = re.compile(r"Executing task '([^']+)'")
END = re.compile(r"Task '([^']+)' finished with status (\w+)")
PIPELINE_END = re.compile(r"Pipeline '([^']+)' finished with status (\w+)")
# the number that says most about a task, first found in its outputs' metadata
KEY_METRICS = ("hard_tgc", "heldout_hard_tgc", "safety_tgc", "easy_tgc", "expert_success_hard_json",
               "base_parameters")


def key_metric(task_dir: Path) -> str:
    """`name=value` of the task's key number, from kfp.local's executor_output.json ('' when it has none)."""
    try:
        out = json.loads((task_dir / "executor_output.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    meta: dict = {}
    for group in out.get("artifacts", {}).values():
        for art in group.get("artifacts", []):
            meta.update(art.get("metadata") or {})
    for name in KEY_METRICS:
        if isinstance(meta.get(name), (int, float)):
            return f"{name}={meta[name]:.4g}"
    return ""


class QuietRun:
    """Within the block, fds 1 and 2 (this process's and every subprocess's) write to `log`; the console gets a line
    per finished task. On leaving, the console is restored; `tail()` gives the log's end for an error report."""

    def __init__(self, log: Path, pipeline_root: Path, console=None, run_prefix: str = "") -> None:
        self.log, self.root, self.run_prefix = Path(log), Path(pipeline_root), run_prefix
        self.console = console if console is not None else sys.stdout
        self.started: dict[str, float] = {}
        self.lines: list[str] = []
        self._stop = threading.Event()

    def _say(self, text: str) -> None:
        os.write(self._out, (text + "\n").encode())
        self.lines.append(text)

    def _task_dir(self, task: str) -> Path:
        runs = sorted((d for d in self.root.iterdir() if d.is_dir() and d.name.startswith(self.run_prefix)),
                      key=lambda d: d.stat().st_mtime) \
            if self.root.exists() else []
        return runs[-1] / task if runs else self.root / task

    def _follow(self) -> None:
        with open(self.log, encoding="utf-8", errors="replace") as fh:
            buf = ""
            while True:
                chunk = fh.read()
                if chunk:
                    buf += chunk
                    *done, buf = buf.split("\n")
                    for line in done:
                        self._line(ANSI.sub("", line))
                elif self._stop.is_set():
                    if buf:
                        self._line(ANSI.sub("", buf))
                    return
                else:
                    time.sleep(0.2)

    def _line(self, line: str) -> None:
        if m := START.search(line):
            self.started[m[1]] = time.monotonic()
        elif m := END.search(line):
            took = time.monotonic() - self.started.get(m[1], time.monotonic())
            self._say(f"  {m[1]:<22} {m[2]:<8} {took:7.1f} s  {key_metric(self._task_dir(m[1]))}".rstrip())
        elif m := PIPELINE_END.search(line):
            self._say(f"  pipeline {m[1]}: {m[2]}")

    def __enter__(self) -> QuietRun:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._out = os.dup(self.console.fileno())
        self._saved = (os.dup(1), os.dup(2))
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self._say(f"agentrl run: executor logs in {self.log} (--verbose streams them here)")
        self._thread = threading.Thread(target=self._follow, name="agentrl-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._stop.set()
        self._thread.join(timeout=10)
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in (*self._saved, self._out):
            os.close(fd)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""
