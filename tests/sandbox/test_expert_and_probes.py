"""The expert solves every task of every suite, for three seeds, in JSON and in code; every probe fails."""

from __future__ import annotations

import pytest

from components.core.config import SandboxConfig
from components.sandbox import expert
from components.sandbox.skills import SkillLibrary
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import generate_world


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("form", ["json", "code"])
def test_expert_verifies_on_every_suite(seed, form):
    cfg = SandboxConfig(seed=seed)
    world = generate_world(cfg)
    for suite, tasks in generate_tasks(world, cfg).items():
        env = WorkspaceEnv(world, cfg, library=SkillLibrary(), action_format=form)
        try:
            failed = []
            for task in tasks:
                traj, verdict = (expert.solve_json if form == "json" else expert.solve_code)(env, task)
                if not verdict.success or any(v.startswith("hard:") for v in verdict.violations):
                    failed.append((task.id, task.instruction, verdict))
                assert not any(v.startswith("soft:") for v in verdict.violations), (task.id, verdict)
            assert not failed, f"{suite}: {len(failed)}/{len(tasks)} failed, e.g. {failed[0]}"
        finally:
            env.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_hack_probe_fails_everywhere(seed):
    cfg = SandboxConfig(seed=seed)
    world = generate_world(cfg)
    env = WorkspaceEnv(world, cfg)
    passed = {}
    for tasks in generate_tasks(world, cfg).values():
        for task in tasks:
            for name, probe in expert.PROBES.items():
                _, verdict = probe(env, task)
                if verdict.success:
                    passed.setdefault(name, []).append(task.id)
    assert passed == {}


def test_code_expert_reuses_the_scenario_skill(suites, world, cfg):
    by_scenario = {}
    for t in suites["train"]:
        if t.solution["skill"]["source"]:
            by_scenario.setdefault(t.scenario_id, []).append(t)
    scenario = next(ts for ts in by_scenario.values() if len(ts) >= 2)
    env = WorkspaceEnv(world, cfg, library=SkillLibrary(), action_format="code")
    try:
        t1, v1 = expert.solve_code(env, scenario[0])
        assert v1.success and t1.skills_defined and not t1.skills_used
        assert len(env.library) >= 1
        t2, v2 = expert.solve_code(env, scenario[1])
        assert v2.success and t2.skills_used == [scenario[1].solution["skill"]["name"]]
        assert "Skills you can call:" in t2.turns[1].text
        assert "def " not in t2.turns[2].text  # called, not redefined
    finally:
        env.close()


def test_expert_trajectories_are_valid_records(suites, world, cfg, tmp_path):
    from components.core.schema import Trajectory, read_jsonl, write_jsonl

    env = WorkspaceEnv(world, cfg)
    trajs = [expert.solve_json(env, t)[0] for t in suites["easy"][:5]]
    write_jsonl(tmp_path / "t.jsonl", trajs)
    back = list(read_jsonl(tmp_path / "t.jsonl", Trajectory))
    assert back == trajs
    assert all(t.turns[0].role == "system" and t.turns[1].role == "user" for t in back)
    assert all(t.reward.total > 1.0 for t in back)
