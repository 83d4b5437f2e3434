"""A mixed, partly hostile load on a sandbox server: many clients (each its own bearer token), each
creating sessions, resetting, stepping with good, bad and hostile actions, verifying, and trying to
reach the other clients' sessions. Used by tests/sandbox/test_http.py (no 500, isolation holds) and by
`make bench` (p99 latency)."""

from __future__ import annotations

import random
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests

from components.core.schema import to_record
from tests.helpers.servers import HOST, _stop, _wait_http, free_port

JSON_ACTIONS = [
    '{"thought": "Looking.", "tool": "mail.search", "args": {"sender": "bob", "limit": 3}}',
    '{"thought": "Reading.", "tool": "chat.read", "args": {"channel": "c1", "limit": 2}}',
    '{"thought": "Checking.", "tool": "calendar.list", "args": {"day": 2}}',
    "I am not sure what to do.",
    '{"tool": "nope", "args": {}}',
    '{"tool": "mail.search", "args": {"query": "\\ud800"}}',
    '{"tool": "mail.read", "args": {"id": ' + "9" * 6000 + "}}",
    '{"tool": "mail.read", "args": {"id": NaN}}',
    "[" * 50_000,
]
CODE_ACTIONS = [
    "Looking.\n```python\nr = apis.mail.search(sender='bob', limit=3)\nprint(len(r['items']))\n```",
    "Busy.\n```python\nn = 0\nfor i in range(200000):\n    n += i\nprint(n)\n```",
    "Escape.\n```python\nimport os\nprint(os.environ)\n```",
    "Escape.\n```python\nprint(().__class__.__base__.__subclasses__())\n```",
    "Match.\n```python\nmatch 1:\n    case int(__class__=c):\n        print(c)\n```",
    "Files.\n```python\nprint(open('/etc/passwd').read())\n```",
]


def make_tokens(n: int) -> dict[str, str]:
    """client name -> bearer token."""
    return {f"c{i:02d}": secrets.token_hex(16) for i in range(1, n + 1)}


def tokens_env(tokens: dict[str, str]) -> str:
    return "\n".join(f"{name}:{tok}" for name, tok in tokens.items())


class SandboxServer:
    """`agentrl sandbox serve` on loopback with `tokens`, stopped by its owner."""

    def __init__(self, tokens: dict[str, str], log: Path, *settings: str) -> None:
        import os

        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        args = [a for s in settings for a in ("--set", s)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli", "sandbox", "serve", "--host", HOST, "--port", str(self.port), *args],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "AGENTRL_SANDBOX_TOKENS": tokens_env(tokens)},
        )
        _wait_http(self.url + "/healthz", self.proc, 60, log)

    def stop(self) -> None:
        _stop(self.proc)


class Client:
    def __init__(self, url: str, name: str, token: str, form: str, tasks: list, shared: dict, seed: int) -> None:
        self.url, self.name, self.form, self.tasks, self.shared = url, name, form, tasks, shared
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"
        self.rng = random.Random(seed)
        self.sid = self.cap = None
        self.log: list[tuple[str, int, float]] = []  # (kind, status, seconds)

    def call(self, kind: str, method: str, path: str, body: Any = None, headers: dict | None = None,
             data: bytes | None = None, session=None) -> requests.Response:
        t0 = time.perf_counter()
        try:
            r = (session or self.http).request(method, self.url + path, json=body if data is None else None,
                                               data=data, headers=headers, timeout=60)
        except requests.ConnectionError:  # counted as status 0: an answer the client never got
            self.log.append((kind, 0, time.perf_counter() - t0))
            return None
        self.log.append((kind, r.status_code, time.perf_counter() - t0))
        return r

    def mine(self) -> dict[str, str]:
        return {"X-Session-Token": self.cap}

    def open(self) -> None:
        r = self.call("create", "POST", "/sessions", {"action_format": self.form})
        if r is not None and r.status_code == 200:
            self.sid, self.cap = r.json()["session"], r.json()["token"]
            self.shared[self.name] = self.sid

    def one(self) -> None:
        if self.sid is None:
            self.open()
            return
        p = self.rng.random()
        s = f"/sessions/{self.sid}"
        if p < 0.12:
            task = to_record(self.rng.choice(self.tasks))
            if self.rng.random() < 0.15:  # over the server's cap, or an option it does not know
                task["options"] = self.rng.choice([{"setup": {"newsletters": 10**6}}, {"shell": "rm -rf /"}])
            self.call("reset", "POST", s + "/reset", {"task": task}, headers=self.mine())
        elif p < 0.72:
            acts = CODE_ACTIONS if self.form == "code" else JSON_ACTIONS
            self.call("step", "POST", s + "/step", {"action": self.rng.choice(acts)}, headers=self.mine())
        elif p < 0.78:
            self.call("verify", "POST", s + "/verify", headers=self.mine())
        elif p < 0.82:
            self.call("skills", "GET", s + "/skills", headers=self.mine())
        elif p < 0.90:  # another client's session, with this client's own valid credentials
            others = [v for k, v in self.shared.items() if k != self.name]
            if others:
                victim = self.rng.choice(others)
                path, method = self.rng.choice([("/step", "POST"), ("/reset", "POST"), ("/verify", "POST"),
                                                ("/skills", "GET"), ("", "DELETE")])
                self.call("cross", method, f"/sessions/{victim}{path}", {"action": "x"}, headers=self.mine())
        elif p < 0.93:
            self.call("noauth", "POST", s + "/step", {"action": "x"}, session=requests)
        elif p < 0.95:
            self.call("oversized", "POST", s + "/step", data=b'{"action": "' + b"a" * (2 << 20) + b'"}',
                      headers={**self.mine(), "content-type": "application/json"})
        elif p < 0.97:
            self.call("delete", "DELETE", s, headers=self.mine())
            self.shared.pop(self.name, None)
            self.sid = None
        else:
            self.call("health", "GET", "/healthz")


EXPECTED = {  # what each kind of request may be answered
    "create": {200, 429}, "reset": {200, 422}, "step": {200}, "verify": {200, 409}, "skills": {200},
    "cross": {403, 404}, "noauth": {401}, "oversized": {413}, "delete": {200}, "health": {200},
}


def mixed_load(url: str, tokens: dict[str, str], tasks: list, requests_total: int = 2000, seed: int = 0) -> dict:
    """`requests_total` requests from len(tokens) concurrent clients. Returns the answers by kind and status,
    the unexpected ones, and latency percentiles (ms)."""
    shared: dict[str, str] = {}
    clients = [Client(url, name, tok, "code" if i % 4 == 3 else "json", tasks, shared, seed + i)
               for i, (name, tok) in enumerate(tokens.items())]
    per = requests_total // len(clients)

    def drive(c: Client) -> None:
        while len(c.log) < per:
            c.one()
        if c.sid:
            c.call("delete", "DELETE", f"/sessions/{c.sid}", headers=c.mine())

    threads = [threading.Thread(target=drive, args=(c,)) for c in clients]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    log = [entry for c in clients for entry in c.log]
    lat = sorted(s for _, _, s in log)

    def pct(q: float) -> float:
        return round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 1)

    return {
        "requests": len(log), "clients": len(clients), "wall_s": round(wall, 1),
        "by_status": dict(Counter(code for _, code, _ in log)),
        "by_kind": {k: dict(Counter(code for kind, code, _ in log if kind == k)) for k in EXPECTED},
        "unexpected": [(k, code) for k, code, _ in log if code not in EXPECTED[k]],
        "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": round(1000 * lat[-1], 1),
    }
