"""The sandbox over HTTP: same contract, identical trajectories, many concurrent sessions."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import asdict

import pytest
import requests

from components.core.env import make
from components.sandbox import expert
from components.sandbox.env import WorkspaceEnv
from components.sandbox.server import HTTPEnvironment
from tests.helpers.servers import HOST, _stop, _wait_http, free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("sandbox") / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "sandbox", "serve", "--host", HOST, "--port", str(port),
         "--set", "sandbox.code_cpu_time_s=1.0", "--set", "sandbox.code_wall_timeout_s=3.0",
         "--set", "sandbox.code_memory_mb=128"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://{HOST}:{port}"
    _wait_http(url + "/healthz", proc, 60, log)
    yield url
    _stop(proc)


def run(env, task, texts):
    first = env.reset(task)
    out = [first, env.system_prompt]
    for text in texts:
        res = env.step(text)
        out.append(res.to_dict())
        if res.done:
            break
    out.append(asdict(env.verify()))
    return out


@pytest.mark.parametrize("form", ["json", "code"])
def test_in_process_and_http_give_identical_trajectories(server, world, cfg, suites, form):
    local = WorkspaceEnv(world, cfg, action_format=form)
    remote = HTTPEnvironment(server, action_format=form)
    recorder = WorkspaceEnv(world, cfg, action_format=form)
    try:
        tasks = [t for s in ("easy", "hard", "safety", "robustness") for t in suites[s][:6]]
        for task in tasks:
            traj, _ = (expert.solve_json if form == "json" else expert.solve_code)(recorder, task)
            texts = [t.text for t in traj.turns if t.role == "assistant"] + ["garbage", '{"tool": "nope"}']
            assert run(local, task, texts) == run(remote, task, texts), task.id
        assert local.library.to_json() != "[]" or form == "json"
    finally:
        local.close()
        remote.close()
        recorder.close()


def test_registered_as_entry_points(server):
    env = make("http", base_url=server)
    try:
        assert requests.get(server + "/healthz", timeout=5).json()["ok"]
    finally:
        env.close()
    assert isinstance(make("workspace"), WorkspaceEnv)


def test_many_concurrent_sessions(server, suites):
    tasks = suites["easy"][:16]
    errors = []

    def worker(i):
        try:
            env = HTTPEnvironment(server)
            local = WorkspaceEnv()
            traj, _ = expert.solve_json(local, tasks[i])
            env.reset(tasks[i])
            for t in traj.turns:
                if t.role == "assistant":
                    env.step(t.text)
            if not env.verify().success:
                errors.append(tasks[i].id)
            env.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_bad_requests_are_clear(server):
    r = requests.post(server + "/sessions/nope/step", json={"action": "x"}, timeout=5)
    assert r.status_code == 404
    sid = requests.post(server + "/sessions", json={}, timeout=5).json()["session"]
    r = requests.post(f"{server}/sessions/{sid}/reset", json={"task": {"schema": "agentrl/task/v9"}}, timeout=5)
    assert r.status_code == 422 and "unknown schema version" in r.text
    r = requests.post(f"{server}/sessions/{sid}/step", json={"action": "hello"}, timeout=5)
    assert r.status_code == 200 and r.json()["done"]  # stepping before reset is an observation, not a crash


def test_hostile_input_gets_an_answer_never_a_500(server, suites):
    from components.core.schema import to_record

    post = lambda path, data: requests.post(server + path, data=data,  # noqa: E731
                                            headers={"content-type": "application/json"}, timeout=10)
    sid = requests.post(server + "/sessions", json={}, timeout=5).json()["session"]
    task = to_record(suites["easy"][0])
    task["instruction"] = "move \ud800 the mail"
    # a task whose text holds a lone surrogate: echoed in the observation as an escape
    r = post(f"/sessions/{sid}/reset", json.dumps({"task": task}))
    assert r.status_code == 200 and "\\ud800" in r.text
    codes = []
    for action in ('{"tool": "mail.search", "args": {"query": "\\ud800"}}', '{"tool": "\\udfff", "args": {}}',
                   '{"tool": "mail.read", "args": {"id": ' + "9" * 6000 + "}}", '{"tool": "mail.read", "args": '
                   '{"id": NaN}}', "[" * 100_000):
        r = post(f"/sessions/{sid}/step", json.dumps({"action": action}))
        codes.append(r.status_code)
        assert r.status_code == 200 and r.json()["observation"].encode("utf-8"), r.text[:300]
    # bodies the server cannot read are the client's error: 422, and the connection stays usable
    for body in ('{"action": ' + "9" * 6000 + "}", '{"action": ' + "[" * 100_000 + "]" * 100_000 + "}", "\xff\xfe",
                 '{"action": "\\ud800"}'):
        r = post(f"/sessions/{sid}/step", body.encode("utf-8", "surrogatepass"))
        codes.append(r.status_code)
    assert 500 not in codes and all(c in (200, 400, 422) for c in codes), codes
    assert requests.delete(f"{server}/sessions/{sid}", timeout=5).status_code == 200
    assert requests.delete(f"{server}/sessions/{sid}", timeout=5).status_code == 404
