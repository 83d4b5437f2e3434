"""The sandbox over HTTP: same contract, identical trajectories, many concurrent sessions; tenants kept apart
(bearer tokens, per-session capability tokens, quotas, caps, a bounded executor) under a mixed hostile load."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import asdict

import pytest
import requests

from components.core.env import make
from components.core.schema import to_record
from components.sandbox import expert
from components.sandbox.server import HTTPEnvironment, parse_tokens
from components.sandbox.workspace import WorkspaceEnv
from tests.helpers.sandbox_load import SandboxServer, make_tokens, mixed_load
from tests.helpers.servers import HOST, free_port

TOKENS = make_tokens(16)
TOK = TOKENS["c01"]
LIMITS = ("sandbox.code_cpu_time_s=1.0", "sandbox.code_wall_timeout_s=3.0", "sandbox.code_memory_mb=128")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = SandboxServer(TOKENS, tmp_path_factory.mktemp("sandbox") / "server.log", *LIMITS)
    yield srv.url
    srv.stop()


def auth(name: str = "c01", cap: str | None = None) -> dict[str, str]:
    h = {"Authorization": f"Bearer {TOKENS[name]}"}
    return {**h, "X-Session-Token": cap} if cap else h


def new_session(url: str, name: str = "c01", form: str | None = None) -> tuple[str, str]:
    r = requests.post(url + "/sessions", json={"action_format": form}, headers=auth(name), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["session"], r.json()["token"]


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
    remote = HTTPEnvironment(server, action_format=form, token=TOK)
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
    env = make("http", base_url=server, token=TOK)
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
            env = HTTPEnvironment(server, token=TOKENS[f"c{i + 1:02d}"])
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
    r = requests.post(server + "/sessions/nope/step", json={"action": "x"}, headers=auth(), timeout=5)
    assert r.status_code == 404
    sid, cap = new_session(server)
    r = requests.post(f"{server}/sessions/{sid}/reset", json={"task": {"schema": "agentrl/task/v9"}},
                      headers=auth(cap=cap), timeout=5)
    assert r.status_code == 422 and "unknown schema version" in r.text
    r = requests.post(f"{server}/sessions/{sid}/step", json={"action": "hello"}, headers=auth(cap=cap), timeout=5)
    assert r.status_code == 200 and r.json()["done"]  # stepping before reset is an observation, not a crash


def test_hostile_input_gets_an_answer_never_a_500(server, suites):
    from components.core.schema import to_record

    sid, cap = new_session(server)
    post = lambda path, data: requests.post(server + path, data=data,  # noqa: E731
                                            headers={"content-type": "application/json", **auth(cap=cap)}, timeout=10)
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
    assert requests.delete(f"{server}/sessions/{sid}", headers=auth(cap=cap), timeout=5).status_code == 200
    assert requests.delete(f"{server}/sessions/{sid}", headers=auth(cap=cap), timeout=5).status_code == 404


def test_one_client_cannot_touch_anothers_session(server, suites):
    sid, cap = new_session(server, "c01")
    task = {"task": to_record(suites["easy"][0])}
    assert requests.post(f"{server}/sessions/{sid}/reset", json=task, headers=auth("c01", cap), timeout=10).ok
    calls = [("POST", "/reset", task), ("POST", "/step", {"action": "x"}), ("POST", "/verify", None),
             ("GET", "/skills", None), ("DELETE", "", None)]
    _, other_cap = new_session(server, "c02")
    for method, path, body in calls:
        url = f"{server}/sessions/{sid}{path}"
        # no bearer token at all; another client's valid bearer without, or with its own, session token;
        # the right session token but no bearer
        assert requests.request(method, url, json=body, timeout=10).status_code == 401
        assert requests.request(method, url, json=body, headers=auth("c02"), timeout=10).status_code == 403
        assert requests.request(method, url, json=body, headers=auth("c02", other_cap), timeout=10).status_code == 403
        assert requests.request(method, url, json=body, headers={"X-Session-Token": cap}, timeout=10).status_code == 401
        bad = {"Authorization": "Bearer " + "x" * 32, "X-Session-Token": cap}
        assert requests.request(method, url, json=body, headers=bad, timeout=10).status_code == 401
    # the owner's session is untouched: its episode goes on
    r = requests.post(f"{server}/sessions/{sid}/step", json={"action": "hello"}, headers=auth("c01", cap), timeout=10)
    assert r.status_code == 200 and r.json()["info"]["turn"] == 1
    assert requests.get(server + "/tools", timeout=5).status_code == 401
    assert requests.get(server + "/healthz", timeout=5).json()["ok"]  # the probe needs no token
    assert requests.delete(f"{server}/sessions/{sid}", headers=auth("c01", cap), timeout=5).status_code == 200


def test_quotas_size_limits_and_task_caps(tmp_path, suites):
    tokens = make_tokens(2)
    srv = SandboxServer(tokens, tmp_path / "server.log", *LIMITS, "sandbox.server.sessions_per_client=2",
                        "sandbox.server.max_request_bytes=65536", "sandbox.server.max_setup_items=200")
    url = srv.url
    try:
        h = {"Authorization": f"Bearer {tokens['c01']}"}
        made = [requests.post(url + "/sessions", json={}, headers=h, timeout=10) for _ in range(3)]
        assert [r.status_code for r in made] == [200, 200, 429] and "c01" in made[2].text
        # one client's quota leaves the others theirs
        r = requests.post(url + "/sessions", json={}, headers={"Authorization": f"Bearer {tokens['c02']}"}, timeout=10)
        assert r.status_code == 200
        sid, cap = made[0].json()["session"], made[0].json()["token"]
        own = {**h, "X-Session-Token": cap}
        big = b'{"action": "' + b"a" * 70_000 + b'"}'
        r = requests.post(f"{url}/sessions/{sid}/step", data=big, headers={**own, "content-type": "application/json"},
                          timeout=10)
        assert r.status_code == 413 and "65536" in r.text
        chunked = requests.post(f"{url}/sessions/{sid}/step", data=iter([big[:40_000], big[40_000:]]),
                                headers={**own, "content-type": "application/json"}, timeout=10)
        assert chunked.status_code == 413  # no Content-Length: counted while it streams
        task = to_record(suites["safety"][0])
        for options, field in [({"setup": {"newsletters": 100_000}}, "options.setup.newsletters"),
                               ({"shell": "x"}, "options.shell"), ({"error_rate": "high"}, "options.error_rate"),
                               ({"setup": {"newsletters": True}}, "options.setup.newsletters")]:
            r = requests.post(f"{url}/sessions/{sid}/reset", json={"task": {**task, "options": options}}, headers=own,
                              timeout=10)
            assert r.status_code == 422 and field in r.text, (options, r.text)
        bulk = next(t for t in suites["safety"] if t.options.get("setup"))  # 120 newsletters: under the cap
        r = requests.post(f"{url}/sessions/{sid}/reset", json={"task": to_record(bulk)}, headers=own, timeout=10)
        assert r.status_code == 200
        assert requests.delete(f"{url}/sessions/{sid}", headers=own, timeout=10).status_code == 200
        assert requests.post(url + "/sessions", json={}, headers=h, timeout=10).status_code == 200  # a slot again
    finally:
        srv.stop()


def test_a_full_executor_answers_at_once_and_health_never_waits(tmp_path, suites):
    tokens = make_tokens(4)
    srv = SandboxServer(tokens, tmp_path / "server.log", *LIMITS, "sandbox.server.workers=2",
                        "sandbox.server.queue=1", "sandbox.code_cpu_time_s=3.0", "sandbox.code_wall_timeout_s=6.0")
    url = srv.url
    busy = "Busy.\n```python\nwhile True:\n    pass\n```"
    try:
        envs = [HTTPEnvironment(url, action_format="code", token=tok, retries=0) for tok in tokens.values()]
        for e in envs:
            e.reset(suites["easy"][0])
        results: list = []
        threads = [threading.Thread(target=lambda e=e: results.append(e.step(busy))) for e in envs[:3]]
        for t in threads:
            t.start()
        for _ in range(600):  # until both workers run a busy step and the third waits in the queue
            health = requests.get(url + "/healthz", timeout=10).json()
            if health["running"] == 2 and health["pending"] == 3:
                break
        assert (health["running"], health["pending"]) == (2, 3), health  # /healthz answered while all were busy
        r = envs[3].http.post(f"{url}/sessions/{envs[3].session}/step", json={"action": "x"}, timeout=10)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        for t in threads:
            t.join()
        assert len(results) == 3  # the busy steps ended at their CPU limit, each with an observation
        for e in envs:
            e.close()
    finally:
        srv.stop()


def test_no_tokens_means_loopback_only(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_SANDBOX_TOKENS"}
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "sandbox", "serve", "--host", "0.0.0.0", "--port",
                          str(free_port())], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "AGENTRL_SANDBOX_TOKENS" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "tokens").write_text("trainer:short\n")
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "sandbox", "serve", "--host", HOST, "--port",
                          str(free_port()), "--token-file", str(tmp_path / "tokens")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "shorter than 16" in out.stderr and "trainer" in out.stderr
    assert parse_tokens("a:" + "x" * 16 + "\n# c\n" + "y" * 16, "t") == {"x" * 16: "a", "y" * 16: "client3"}


@pytest.mark.slow
def test_two_thousand_mixed_requests_from_sixteen_clients(server, suites):
    tasks = [t for s in ("easy", "hard", "safety", "robustness") for t in suites[s][:10]]
    out = mixed_load(server, TOKENS, tasks, requests_total=2000)
    print("mixed load:", out)
    assert out["requests"] >= 2000
    assert out["unexpected"] == [], out["unexpected"][:20]
    assert not any(code >= 500 for code in out["by_status"]), out["by_status"]
    assert sum(out["by_kind"]["cross"].values()) > 50 and set(out["by_kind"]["cross"]) <= {403, 404}
    assert out["by_kind"]["step"].get(200, 0) > 800


def test_env_url_runs_a_phases_episodes_on_the_server(server, monkeypatch, tmp_path):
    """`env.url`: the environment a phase loads runs its episodes on the server (the policy's actions never execute
    in the phase's process); the same greedy numbers as in-process; a server with another world is refused before
    any episode."""
    from components.core import env as environments
    from components.core.config import load_config
    from components.core.evaluate import evaluate_policy
    from components.core.policy import load_policy
    from components.core.tiny import build_tiny_model
    from components.sandbox.server import CLIENT_TOKEN_ENV
    from tests.helpers.scripted import ScriptedBackend, expert_script

    monkeypatch.setenv(CLIENT_TOKEN_ENV, TOK)
    local = load_config(overrides_json=json.dumps({"model": {"tiny": {"pretrain_steps": 0}}}))
    remote = local.model_copy(update={"env": local.env.model_copy(update={"url": server})})
    here, there = environments.load(local), environments.load(remote)
    episode = there.factory()()
    assert isinstance(episode, HTTPEnvironment)
    episode.close()
    pol = load_policy(str(build_tiny_model(tmp_path / "tiny", local.model.tiny, seed=0)))
    sessions_before = requests.get(server + "/healthz", timeout=10).json()["sessions"]
    runs = {}
    for name, env, cfg in (("local", here, local), ("served", there, remote)):
        res = evaluate_policy(pol, cfg, env, ["easy", "safety"], max_tasks=4, progress=False,
                              backend=ScriptedBackend(pol.tokenizer, expert_script(here)))
        runs[name] = res
    assert runs["served"]["metrics"] == runs["local"]["metrics"]
    assert runs["served"]["metrics"]["easy"]["tgc"]["value"] == 1.0
    served = [t.turns[3].text for t in runs["served"]["trajectories"]["easy"]]
    assert served == [t.turns[3].text for t in runs["local"]["trajectories"]["easy"]]  # the server's observations
    assert requests.get(server + "/healthz", timeout=10).json()["sessions"] == sessions_before  # all closed
    # another world on the server than the tasks'
    other = load_config(set_pairs=["sandbox.num_users=5", f"env.url={server}"])
    with pytest.raises(ValueError, match="env.url=.*serves world"):
        environments.load(other)
    with pytest.raises(ValueError, match="env.url=.*no environment server answers"):
        environments.load(load_config(set_pairs=[f"env.url=http://{HOST}:{free_port()}"]))
