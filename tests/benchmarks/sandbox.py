"""Sandbox throughput: environment steps per second, JSON in-process, code in the isolated worker, and HTTP."""

from __future__ import annotations

import subprocess
import sys
import time

from components.core.config import SandboxConfig
from components.sandbox.expert import render_code, render_json
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import generate_world


def _actions(task, form):
    if form == "json":
        return [render_json("Looking.", "mail.search", {"sender": "bob", "limit": 3}),
                render_json("Reading the channel.", "chat.read", {"channel": "c1", "limit": 2}),
                render_json("Checking.", "calendar.list", {"day": 2})]
    return [render_code("Looking.", "r = apis.mail.search(sender='bob', limit=3)\nprint(len(r['items']))")]


def _loop(env, tasks, form, seconds: float) -> float:
    acts = _actions(tasks[0], form)
    n, i = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        env.reset(tasks[i % len(tasks)])
        i += 1
        for _ in range(8):
            res = env.step(acts[n % len(acts)])
            n += 1
            if res.done:
                break
    return n / (time.perf_counter() - t0)


def bench_sandbox(out: dict, seconds: float = 3.0) -> None:
    cfg = SandboxConfig()
    world = generate_world(cfg)
    tasks = generate_tasks(world, cfg)["easy"]
    env = WorkspaceEnv(world, cfg)
    json_rate = _loop(env, tasks, "json", seconds)
    env.action_format = "code"
    code_rate = _loop(env, tasks, "code", seconds)
    env.close()
    out["sandbox.json_steps_per_s"] = {"value": round(json_rate), "unit": "steps/s", "goal": 20000, "baseline": None,
                                       "ratio": round(json_rate / 20000, 3)}
    out["sandbox.code_steps_per_s"] = {"value": round(code_rate), "unit": "steps/s", "goal": 1000, "baseline": None,
                                       "ratio": round(code_rate / 1000, 3)}
    # HTTP: the same loop against `agentrl sandbox serve` on loopback
    from components.sandbox.server import HTTPEnvironment
    from tests.helpers.servers import HOST, _stop, _wait_http, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "sandbox", "serve", "--host", HOST, "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_http(f"http://{HOST}:{port}/healthz", proc, 60)
        remote = HTTPEnvironment(f"http://{HOST}:{port}")
        http_rate = _loop(remote, tasks, "json", seconds)
        remote.close()
    finally:
        _stop(proc)
    # 2,000 mixed, partly hostile requests from 16 clients with their own tokens (tests/helpers/sandbox_load.py)
    import tempfile
    from pathlib import Path

    from tests.helpers.sandbox_load import SandboxServer, make_tokens, mixed_load

    tokens = make_tokens(16)
    with tempfile.TemporaryDirectory() as tmp:
        srv = SandboxServer(tokens, Path(tmp) / "server.log")
        try:
            load = mixed_load(srv.url, tokens, [t for s in ("easy", "hard", "safety") for t in
                                                generate_tasks(world, cfg)[s][:10]], requests_total=2000)
        finally:
            srv.stop()
    fives = sum(n for code, n in load["by_status"].items() if code >= 500)
    out["sandbox.http_p99_ms_16_clients"] = {"value": load["p99_ms"], "unit": "ms", "goal": 1000, "baseline": None,
                                             "ratio": round(load["p99_ms"] / 1000, 3), "p50_ms": load["p50_ms"],
                                             "requests": load["requests"], "answers_5xx": fives}
    out["sandbox.http_steps_per_s"] = {"value": round(http_rate), "unit": "steps/s", "goal": None,
                                       "baseline": round(json_rate), "ratio": round(http_rate / json_rate, 4)}
