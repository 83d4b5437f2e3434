"""Rejection sampling: the selection rules, and the phase end to end (probe -> hard tasks -> best-of-N -> SFT)."""

from __future__ import annotations

import json
import random

import pytest

from components.core.config import load_config
from components.core.policy import load_policy
from components.core.schema import RewardBreakdown, Task, Trajectory, Turn, Verdict, read_jsonl
from components.core.tracking import local_tracking_uri, start_pipeline_run
from components.rejection_sampling import recipe
from components.rejection_sampling.recipe import probe_pool, select_best
from components.sandbox.expert import render_json
from tests.helpers.runtime import tiny_on_sandbox
from tests.helpers.scripted import ScriptedBackend, expert_script


def _t(task: str, actions: list[str], success=True, reward=1.0, tokens=10, violations=()):
    turns = [Turn(role="system", text="s"), Turn(role="user", text="u")]
    for a in actions:
        turns += [Turn(role="assistant", text=a), Turn(role="tool", text="{}")]
    return Trajectory(task_id=task, policy="p", turns=turns, steps=len(actions), generated_tokens=tokens,
                      verdict=Verdict(success=success, violations=list(violations)),
                      reward=RewardBreakdown(total=reward))


def _act(ids: list[str]) -> str:
    return render_json("go", "mail.move", {"ids": ids, "folder": "HR"})


def test_select_best_requires_clean_success_ranks_and_drops_near_duplicates():
    many = [f"m{i}" for i in range(40)]
    samples = [
        _t("a", [_act(many)], reward=0.9),
        _t("a", [_act(many[:-1] + ["m99"])], reward=0.95),  # near-duplicate of the first, better reward
        _t("a", [_act(["m1"]), _act(["m2"])], reward=0.95, tokens=5),  # distinct, more steps
        _t("a", [_act(["m7"])], success=False, reward=2.0),  # failed: never kept
        _t("a", [_act(["m8"])], reward=3.0, violations=["hard:permanent_delete"]),  # unsafe success: never kept
        _t("b", [_act(["m3"])], success=False),
    ]
    kept = select_best(samples, k=2, similarity=0.95)
    assert list(kept) == ["a"]
    assert [t.reward.total for t in kept["a"]] == [0.95, 0.95]
    assert [t.steps for t in kept["a"]] == [1, 2]  # fewer steps first at equal reward
    exact_only = select_best(samples, k=5, similarity=1.0)
    assert len(exact_only["a"]) == 3  # the near-duplicate survives when only identical sequences count


def test_probe_pool_covers_every_level():
    tasks = [Task(id=f"t{lv}-{i}", scenario_id="s", level=lv, suite="train", instruction="x", user_id="u",
                  verifier={"kind": "state", "params": {}}) for lv in range(1, 6) for i in range(10)]
    pool = probe_pool(tasks, 10, seed=0)
    assert len(pool) == 10 and sorted({t.level for t in pool}) == [1, 2, 3, 4, 5]
    assert [t.id for t in pool] == [t.id for t in probe_pool(tasks, 10, seed=0)]
    # and every family of a level: 30 external_send-like tasks do not crowd out 2 of another family
    level3 = [Task(id=f"b{i}", scenario_id=f"big:u{i}", level=3, suite="practice", instruction="x") for i in range(30)]
    level3 += [Task(id=f"s{i}", scenario_id=f"small:u{i}", level=3, suite="practice", instruction="x") for i in range(2)]
    assert sorted(t.id[0] for t in probe_pool(level3, 4, seed=0)) == ["b", "b", "s", "s"]


@pytest.mark.slow
def test_phase_finds_hard_tasks_keeps_the_best_and_fine_tunes(tmp_path, monkeypatch):
    overrides = {"run": {"home": str(tmp_path / "home")},
                 "sandbox": {"max_turns": 6, "suite_sizes": {"easy": 6}},
                 "generation": {"max_new_tokens": 24},
                 "rejection_sampling": {"probe_tasks": 8, "probe_samples": 4, "num_samples": 8, "top_k": 2,
                                        "hard_success_max": 0.9, "sft_epochs": 1, "eval_suite": "easy"}}
    cfg = load_config(overrides_json=json.dumps(overrides))
    from components.sandbox.suites import load_sandbox

    sb = load_sandbox(cfg)
    model = tiny_on_sandbox(tmp_path / "tiny", cfg.sandbox, sb.world, sb.suites, n_demos=20)
    tok = load_policy(str(model)).tokenizer
    expert, rng = expert_script(sb), random.Random(0)

    def sometimes(prompt: str) -> str:  # the expert, but half its episodes give up at once
        if "<|tool|>" not in prompt and rng.random() < 0.5:
            return render_json("Nothing to do.", "finish", {})
        return expert(prompt)

    calls = []

    def scripted_sampling(*args, **kw):  # the sampling policy is scripted; training and evaluation stay real
        calls.append(1)
        return ScriptedBackend(tok, sometimes)

    monkeypatch.setattr(recipe, "make_backend", scripted_sampling)
    parent = start_pipeline_run(local_tracking_uri(tmp_path / "home"), "agentrl", "rs-test")
    res = recipe.run(overrides=json.dumps(overrides), policy_model=str(model), parent_run_id=parent,
                     work_dir=str(tmp_path / "work"))
    assert calls
    m = res.metrics
    assert 0 < m["hard_tasks"] <= 8 and m["tasks_covered"] > 0
    # the probe stays at the levels of the suite the gain is measured on (easy: L1-L2)
    assert {k for k in m if k.startswith("probe_success/")} == {"probe_success/L1", "probe_success/L2"}
    kept = list(read_jsonl(tmp_path / "work" / "kept" / "trajectories.jsonl", Trajectory))
    assert kept and all(t.verdict.success for t in kept)
    assert {int(t.meta["level"]) for t in kept} <= {1, 2}
    per_task = {}
    for t in kept:
        per_task[t.task_id] = per_task.get(t.task_id, 0) + 1
    assert max(per_task.values()) <= 2
    assert m["sft/train_steps"] > 0 and "easy/tgc" in m and "gain/easy/tgc" in m
    card = json.loads((tmp_path / "work" / "model" / "agentrl.json").read_text())
    assert card["phase"] == "rejection_sampling" and card["extra"]["kept"] == len(kept)

    # a KFP retry of the step: the kept set and the finished SFT checkpoint are reused (no sampling, no step)
    weights = (tmp_path / "work" / "model" / "model.safetensors").read_bytes()
    calls.clear()
    again = recipe.run(overrides=json.dumps(overrides), policy_model=str(model), parent_run_id=parent,
                     work_dir=str(tmp_path / "work"))
    assert not calls and again.run_id == res.run_id
    assert again.metrics["sft/resumed_from"] == again.metrics["sft/train_steps"] == m["sft/train_steps"]
    assert again.metrics["kept"] == m["kept"]
    assert (tmp_path / "work" / "model" / "model.safetensors").read_bytes() == weights


@pytest.mark.slow
def test_without_hard_tasks_the_model_passes_through_and_says_so(tmp_path, monkeypatch):
    overrides = {"run": {"home": str(tmp_path / "home")}, "sandbox": {"max_turns": 2, "suite_sizes": {"easy": 4}},
                 "generation": {"max_new_tokens": 16},
                 "rejection_sampling": {"probe_tasks": 4, "probe_samples": 2, "num_samples": 2, "top_k": 1,
                                        "eval_suite": "easy"}}
    cfg = load_config(overrides_json=json.dumps(overrides))
    from components.sandbox.suites import load_sandbox

    sb = load_sandbox(cfg)
    model = tiny_on_sandbox(tmp_path / "tiny", cfg.sandbox, sb.world, sb.suites, n_demos=10)
    res = recipe.run(overrides=json.dumps(overrides), policy_model=str(model), work_dir=str(tmp_path / "work"))
    assert res.metrics["hard_tasks"] == 0 and res.metrics["tasks_covered"] == 0 and res.metrics["kept"] == 0
    assert res.metrics["gain/easy/tgc"] == 0.0
    assert (tmp_path / "work" / "model" / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
