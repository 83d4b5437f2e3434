from __future__ import annotations

import json

from components.core.schema import Task, Verifier
from components.sandbox.expert import render_code
from components.sandbox.skills import Skill, SkillLibrary, jaccard
from components.sandbox.workspace import WorkspaceEnv


def mk(name, scenario, instruction="Move the emails from alice about budget to HR.") -> Skill:
    return Skill(name, f"def {name}(x):\n    return x", f"t-{name}", scenario, instruction)


def test_retrieval_same_scenario_first_then_ngram_jaccard():
    lib = SkillLibrary([mk("a", "s1"), mk("b", "s2", "Schedule a meeting with bob on day 3"),
                        mk("c", "s3", "Move the emails from carol about hiring to Finance.")])
    assert [s.name for s in lib.retrieve("s1", "anything")] == ["a"]
    got = lib.retrieve("s9", "Move the emails from dave about launch to HR.", k=2)
    assert [s.name for s in got] == ["a", "c"]
    assert lib.retrieve("s9", "zzz qqq", k=2) == []
    assert jaccard("move the emails", "move the emails") == 1.0


def test_retrieved_skills_come_with_their_helpers_and_never_clash():
    helper_a = Skill("move_from", "def move_from(s, t, f):\n    return apis.mail.move(ids=[], folder=f)", "t1",
                     "move:bob", "Move the emails from alice about budget to HR.")
    helper_b = Skill("move_from", "def move_from(s, t, f):\n    return []", "t2", "weekly:bob",
                     "Weekly cleanup: move the emails from alice about budget to HR.")
    weekly = Skill("weekly", "def weekly(a):\n    return move_from(*a)", "t2", "weekly:bob",
                   "Weekly cleanup: move the emails from alice about budget to HR.")
    lib = SkillLibrary([helper_b, weekly, helper_a])
    got = lib.retrieve("weekly:carol", "Weekly cleanup: move the emails from dave about launch to HR.", k=4)
    by_name = {s.name: s.task_id for s in got}
    assert by_name == {"weekly": "t2", "move_from": "t2"}  # weekly's own helper, not the other move_from
    assert lib.retrieve("weekly:carol", "Weekly cleanup", k=1) == []  # a group that does not fit is left out


def test_library_roundtrip_and_latest_definition_wins():
    lib = SkillLibrary()
    lib.add(mk("a", "s1"))
    lib.add(Skill("a", "def a(x):\n    return 2", "t2", "s1", "x"))
    assert len(lib) == 1 and lib.skills[0].task_id == "t2"
    assert SkillLibrary.from_json(lib.to_json()).skills == lib.skills


def test_only_skills_used_in_a_verified_task_are_saved(world, cfg, suites):
    from tests.sandbox.conftest import first

    task = first(suites, "move_one", "train")
    folder = task.verifier.params["expect"]
    (path, value), = folder.items()
    mid = path.split("/")[1]
    env = WorkspaceEnv(world, cfg, action_format="code")
    try:
        env.reset(task)
        code = (f"def unused(x):\n    return x\n\ndef mv(i, f):\n    return apis.mail.move(ids=[i], folder=f)\n\n"
                f"mv({mid!r}, {value!r})\napis.finish()")
        env.step(render_code("I will write a helper and use it.", code))
        assert env.verify().success
        assert [s.name for s in env.library.skills] == ["mv"]
        # a failed task saves nothing
        env.reset(task)
        env.step(render_code("Write a helper and give up.", "def mv2(i):\n    return i\nmv2(1)\napis.finish()"))
        assert not env.verify().success
        assert [s.name for s in env.library.skills] == ["mv"]
        # retrieved skills are listed in the prompt and callable without redefinition
        first_obs = env.reset(task)
        assert "Skills you can call: mv(i, f)" in first_obs
        res = env.step(render_code("Use the skill.", f"mv({mid!r}, {value!r})\napis.finish()"))
        assert json.loads(res.observation)["ok"] and res.info["skills_used"] == ["mv"]
        assert env.verify().success and env.episode_info()["skills_used"] == ["mv"]
    finally:
        env.close()


def test_skills_do_not_leak_between_environments(world, cfg):
    a, b = WorkspaceEnv(world, cfg, action_format="code"), WorkspaceEnv(world, cfg, action_format="code")
    t = Task("t", "s:alice", 1, "train", "x", "alice", Verifier("state", {}))
    try:
        a.reset(t)
        a.step(render_code("define", "def helper():\n    return 1"))
        b.reset(t)
        obs = json.loads(b.step(render_code("call", "print(helper())")).observation)
        assert not obs["ok"] and "NameError" in obs["error"]
    finally:
        a.close()
        b.close()
