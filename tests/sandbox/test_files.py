"""The file-defined environment (sandbox/files.py) and its example domain, the help desk."""

from __future__ import annotations

import json
import shutil

import pytest

from components.core.config import load_config
from components.core.env import load, loader_names
from components.sandbox.files import FileEnv, SpecError, example_path, parse_calls, read_spec


@pytest.fixture(scope="module")
def helpdesk():
    return load(load_config(set_pairs=["env.name=helpdesk"]))


def test_the_help_desk_is_registered_solvable_and_holds_its_suites_apart(helpdesk):
    assert {"workspace", "files", "helpdesk"} <= loader_names()
    assert helpdesk.heldout == ("easy", "hard") and set(helpdesk.suites) == {"train", "practice", "easy", "hard"}
    assert {t.level for t in helpdesk.suites["hard"]} == {3, 4, 5} and {t.level for t in helpdesk.suites["easy"]} == {1, 2}
    # no held-out request (instruction and state) is one that training shows
    seen = {(t.instruction, json.dumps(t.payload, sort_keys=True)) for s in ("train", "practice")
            for t in helpdesk.suites[s]}
    assert not any((t.instruction, json.dumps(t.payload, sort_keys=True)) in seen
                   for s in helpdesk.heldout for t in helpdesk.suites[s])
    env = helpdesk.factory()()
    try:
        for suite, tasks in helpdesk.suites.items():
            trajs = [helpdesk.expert(env, t) for t in tasks[:15]]
            assert all(t.verdict.success for t in trajs), suite
    finally:
        env.close()


def test_an_episode_has_two_calls_in_one_reply_and_the_users_follow_up(helpdesk):
    task = next(t for t in helpdesk.suites["hard"] if t.level == 5)
    traj = helpdesk.expert(None, task)
    assert [t.role for t in traj.turns] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant",
                                            "tool", "assistant", "tool"]
    assert [n for n, _ in parse_calls(traj.turns[2].text)] == ["assign", "set_status"]  # two calls, one reply
    assert traj.turns[2].text.startswith("I will assign ")  # a short thought first
    assert traj.turns[3].text.count('"result": "ok"') == 2
    assert traj.turns[5].text.startswith("Thanks. Also add the comment")
    assert traj.verdict.success and "follow_up" in traj.verdict.subgoals_done
    assert traj.turns[0].info["tools"] == read_spec(example_path()).tools


def test_wrong_calls_are_observations_with_their_reward_parts(helpdesk):
    env = FileEnv(helpdesk.spec)
    try:
        task = helpdesk.suites["train"][0]
        env.reset(task)
        r = env.step('{"name": "no_such_tool", "arguments": {}}')
        assert "unknown tool 'no_such_tool'" in r.observation and r.info["reward_parts"] == {"tool_error": -0.05}
        r = env.step('{"name": "get_ticket", "arguments": {"ticket_id": "T-0"}}')
        assert "KeyError" in r.observation and not r.done
        r = env.step('thinking {"name": "get_ticket", ')
        assert r.info["format_error"] and r.info["reward_parts"] == {"format_error": -0.1}
        other = sorted(set(task.payload["state"]["tickets"]) - set(task.payload["expect"]))[0]
        r = env.step(json.dumps({"name": "set_status", "arguments": {"ticket_id": other, "status": "resolved"}}))
        r = env.step("That is all.")
        assert r.done
        verdict = env.verify()
        assert not verdict.success and verdict.violations == [f"hard: changed ticket {other}, which the request did not name"]
        assert env.episode_info() == {"format_errors": 1}
    finally:
        env.close()


@pytest.mark.parametrize("text,calls", [
    ("All done.", []),
    ('{"name": "a", "arguments": {"x": 1}}', [("a", {"x": 1})]),
    ('[{"name": "a", "arguments": {}}, {"name": "b"}]', [("a", {}), ("b", {})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"y": "z"}}'
     '</tool_call>', [("a", {}), ("b", {"y": "z"})]),
    ("the list [1, 2 is prose", []),
])
def test_calls_are_read_in_every_form_a_model_writes_them(text, calls):
    assert parse_calls(text) == calls


@pytest.mark.parametrize("text", ['{"name": "a", "arguments": ', '{"tool": "a"}', '{"name": "a", "arguments": [1]}'])
def test_json_that_is_not_a_call_is_a_format_error(text):
    with pytest.raises(ValueError):
        parse_calls(text)


def _folder(tmp_path, tools_py: str):
    root = tmp_path / "env"
    shutil.copytree(example_path(), root)
    (root / "tools.py").write_text(tools_py)
    return root


def test_the_tool_module_runs_behind_the_workers_walls(tmp_path, helpdesk):
    evil = (read_spec(example_path()).source + "\n\n"
            "def get_ticket(state, ticket_id):\n"
            "    if ticket_id == 'os':\n"
            "        import os\n"
            "        return os.listdir('/')\n"
            "    if ticket_id == 'open':\n"
            "        return open('/etc/hostname').read()\n"
            "    if ticket_id == 'spin':\n"
            "        while True:\n"
            "            pass\n"
            "    return {'id': ticket_id}\n")
    spec = read_spec(_folder(tmp_path, evil))
    env = FileEnv(spec)
    try:
        env.reset(helpdesk.suites["train"][0])
        for probe, error in (("os", "ImportError"), ("open", "NameError")):
            r = env.step(json.dumps({"name": "get_ticket", "arguments": {"ticket_id": probe}}))
            assert f'"error": "{error}' in r.observation and not r.done
        r = env.step(json.dumps({"name": "get_ticket", "arguments": {"ticket_id": "spin"}}))
        assert r.done and r.info["truncated"] == "environment_error"  # the worker is gone, and its state with it
        assert not env.verify().success
        env.reset(helpdesk.suites["train"][1])  # the next episode gets a fresh worker
        assert "T-" in env.step(json.dumps({"name": "get_ticket", "arguments": {"ticket_id": "T-1"}})).observation
    finally:
        env.close()


def test_a_folder_that_does_not_say_what_it_must_is_named_with_the_reason(tmp_path):
    root = _folder(tmp_path, "def get_ticket(state, ticket_id):\n    return 1\n")
    with pytest.raises(SpecError, match=r"tools.py: defines no \['find_agent'"):
        read_spec(root)
    root = _folder(tmp_path / "b", read_spec(example_path()).source)
    (root / "tools.json").write_text('[{"type": "function", "function": {"name": "bad name"}}]')
    with pytest.raises(SpecError, match=r"tools.json\[0\]: expected"):
        read_spec(root)
    root = _folder(tmp_path / "c", read_spec(example_path()).source)
    with (root / "tasks" / "easy.jsonl").open("a") as f:
        f.write('{"id": "x"}\n')
    with pytest.raises(SpecError, match=r"easy.jsonl:41: KeyError"):
        read_spec(root)
    (root / "tasks" / "hard.jsonl").unlink()
    (root / "tasks" / "easy.jsonl").write_text((tmp_path / "env" / "tasks" / "easy.jsonl").read_text())
    with pytest.raises(SpecError, match=r"hard.jsonl: missing or empty"):
        read_spec(root)
    cfg = load_config(set_pairs=["env.name=files"])
    with pytest.raises(ValueError, match="env.options.path"):
        load(cfg)


def test_any_registered_environment_is_served_and_its_episodes_run_there(tmp_path, helpdesk):
    import subprocess
    import sys

    import requests

    from components.sandbox.files import render_reply
    from tests.helpers.servers import HOST, _stop, _wait_http, free_port

    url, log = f"http://{HOST}:{free_port()}", tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "env", "serve", "--env", "helpdesk", "--host", HOST,
                             "--port", url.rsplit(":", 1)[1]], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_http(url + "/healthz", proc, 60, log)
        assert requests.get(url + "/healthz", timeout=10).json()["world"] == helpdesk.spec.digest()[:16]
        assert requests.get(url + "/tools", timeout=10).json() == helpdesk.spec.tools
        served = load(load_config(set_pairs=["env.name=helpdesk", f"env.url={url}"]))  # the server is checked first
        task = next(t for t in served.suites["hard"] if t.level == 5)
        env = served.factory()()
        try:
            env.reset(task)
            assert env.tools == helpdesk.spec.tools and env.system_prompt == helpdesk.spec.system_prompt
            roles = []
            for reply in task.solution["replies"]:
                res = env.step(render_reply(reply))
                roles.append(res.role)
                if res.done:
                    break
            assert roles == ["tool", "user", "tool", "tool"] and env.verify().success  # the follow-up, over HTTP
            assert requests.get(f"{url}/sessions/{env.session}/skills", timeout=10).status_code in (403, 404)
        finally:
            env.close()
        assert requests.get(url + "/healthz", timeout=10).json()["sessions"] == 0
        # a phase whose tasks come from another version of the folder is stopped before any episode
        other = _folder(tmp_path, read_spec(example_path()).source)
        (other / "env.json").write_text((other / "env.json").read_text().replace("help-desk agent", "support agent"))
        with pytest.raises(ValueError, match="env.url=.*serves world .*agentrl env serve --env files"):
            load(load_config(set_pairs=["env.name=files", f"env.options.path={other}", f"env.url={url}"]))
    finally:
        _stop(proc)


def test_the_workspace_declares_its_tools_as_json_schemas_too():
    from components.sandbox.apis import CATALOGUE

    sandbox = load(load_config(set_pairs=["sandbox.catalogue=schemas"]))
    traj = sandbox.expert(sandbox.factory()(), sandbox.suites["train"][0])
    tools = traj.turns[0].info["tools"]
    assert traj.verdict.success and [t["function"]["name"] for t in tools] == [t.name for t in CATALOGUE]
    move = next(t["function"] for t in tools if t["function"]["name"] == "mail.move")
    assert move["parameters"]["properties"]["ids"] == {"type": "array", "items": {"type": "string"}}
    assert "Tools:" not in traj.turns[0].text  # declared to the template, not listed in the prompt
    assert load(load_config()).factory()().tools is None  # the default lists none: learned from the demos
