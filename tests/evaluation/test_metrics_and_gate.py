from __future__ import annotations

import pytest

from components.core.config import GateConfig
from components.core.evaluate import flat, suite_metrics
from components.core.schema import RewardBreakdown, Trajectory, Turn, Verdict
from components.evaluation.gate import decide, deltas, paired_delta


def traj(task, scenario, ok, steps=2, hard=False, fmt=0, skills=()):
    turns = [Turn("system", "s"), Turn("user", "u")]
    for i in range(steps):
        turns += [Turn("assistant", "a"), Turn("tool", "o", info={"format_error": True} if i < fmt else {})]
    return Trajectory(task, "p", turns, Verdict(ok, [], ["hard:x"] if hard else []), RewardBreakdown(0, {}),
                      steps=steps, generated_tokens=10 * steps, skills_used=list(skills),
                      meta={"scenario_id": scenario, "level": 1})


def test_suite_metrics_values_and_intervals():
    trajs = [traj("a", "s1", True), traj("b", "s1", True), traj("c", "s2", True), traj("d", "s2", False, hard=True, fmt=1),
             traj("e", "s3", False, steps=4, skills=["mv"])]
    m = suite_metrics(trajs, samples=[[traj("a", "s1", False), traj("a", "s1", True)], [traj("e", "s3", False)] * 2],
                      n_boot=200, seed=0)
    assert m["tgc"]["value"] == pytest.approx(0.6)
    assert m["sgc"]["value"] == pytest.approx(1 / 3, abs=1e-6)  # only s1 has every task solved
    assert m["safety_violation_rate"]["value"] == pytest.approx(0.2)
    assert m["format_error_rate"]["value"] == pytest.approx(1 / 12, abs=1e-6)
    assert m["valid_action_rate"]["value"] == pytest.approx(11 / 12, abs=1e-6)
    assert m["avg_steps"]["value"] == pytest.approx(12 / 5) and m["tokens_per_task"]["value"] == pytest.approx(24)
    assert m["skill_reuse_rate"]["value"] == pytest.approx(0.2) and m["pass_at_k"]["value"] == pytest.approx(0.5)
    for v in m.values():
        assert v["ci"][0] <= v["value"] <= v["ci"][1]
    assert m["tgc"]["ci"][0] < m["tgc"]["ci"][1]
    assert suite_metrics(trajs, n_boot=200, seed=0) == suite_metrics(trajs, n_boot=200, seed=0)
    # what phases log as held-out metrics keeps TGC's interval
    f = flat({"hard": m})
    assert (f["hard/tgc"], [f["hard/tgc_ci_lo"], f["hard/tgc_ci_hi"]]) == (m["tgc"]["value"], m["tgc"]["ci"])
    assert "hard/sgc_ci_lo" not in f


def M(**suites):
    return {s: {k: {"value": v, "ci": [v, v]} for k, v in ms.items()} for s, ms in suites.items()}


def test_gate_refuses_a_safety_regression_and_promotes_an_improvement():
    gate = GateConfig(hard_tgc_min_delta=0.0, max_safety_violation_rate=0.001, max_suite_regression=0.05)
    champ = M(easy={"tgc": 0.5, "safety_violation_rate": 0.0}, hard={"tgc": 0.2, "safety_violation_rate": 0.0},
              safety={"tgc": 0.5, "safety_violation_rate": 0.0})
    better = M(easy={"tgc": 0.6, "safety_violation_rate": 0.0}, hard={"tgc": 0.3, "safety_violation_rate": 0.0},
               safety={"tgc": 0.6, "safety_violation_rate": 0.0})
    unsafe = M(easy={"tgc": 0.9, "safety_violation_rate": 0.0}, hard={"tgc": 0.9, "safety_violation_rate": 0.0},
               safety={"tgc": 0.9, "safety_violation_rate": 0.1})
    regress = M(easy={"tgc": 0.3, "safety_violation_rate": 0.0}, hard={"tgc": 0.5, "safety_violation_rate": 0.0},
                safety={"tgc": 0.6, "safety_violation_rate": 0.0})
    assert decide(better, champ, gate).promote
    d = decide(unsafe, champ, gate)
    assert not d.promote and any("safety violation rate 0.1000 > 0.0010" in r for r in d.reasons)
    d = decide(regress, champ, gate)
    assert not d.promote and any("easy TGC 0.3000 regresses" in r for r in d.reasons)
    assert not decide(M(hard={"tgc": 0.1, "safety_violation_rate": 0.0}), champ, gate).promote
    assert decide(better, None, gate).promote and not decide(unsafe, None, gate).promote
    assert deltas(better, champ)["hard/tgc"] == pytest.approx(0.1)


def test_paired_gate_refuses_only_what_is_worse_beyond_the_interval():
    """The hard suite decides on candidate minus champion over the same tasks, scenarios resampled: a drop inside
    the noise passes, a drop beyond it is refused; the safety suite may not get worse than the champion's."""
    gate = GateConfig(hard_tgc_min_delta=0.0, max_safety_violation_rate=0.5, max_suite_regression=1.0)
    scen = [f"s{i}" for i in range(20)]
    champ_h = [traj(f"t{i}", scen[i], i < 10) for i in range(20)]
    noisy = [traj(f"t{i}", scen[i], i < 9 or i == 15) for i in range(20)]  # one task lost, another won
    worse = [traj(f"t{i}", scen[i], i < 2) for i in range(20)]  # 8 of 10 solved tasks lost
    d, lo, hi = paired_delta(noisy, champ_h, n_boot=400, seed=0)
    assert d == 0.0 and lo < 0 < hi
    d, lo, hi = paired_delta(worse, champ_h, n_boot=400, seed=0)
    assert d == pytest.approx(-0.4) and hi < 0
    with pytest.raises(ValueError, match="share no task"):
        paired_delta([traj("x", "s", True)], champ_h)
    champ = M(hard={"tgc": 0.5, "safety_violation_rate": 0.0}, safety={"tgc": 0.5, "safety_violation_rate": 0.0})
    cand = M(hard={"tgc": 0.5, "safety_violation_rate": 0.0}, safety={"tgc": 0.5, "safety_violation_rate": 0.0})
    ok = decide(cand, champ, gate, {"hard": paired_delta(noisy, champ_h, n_boot=400)})
    assert ok.promote and any("vs champion" in r and "reaches" in r for r in ok.reasons)
    bad = decide(cand, champ, gate, {"hard": paired_delta(worse, champ_h, n_boot=400)})
    assert not bad.promote and any("lies below" in r for r in bad.reasons)
    less_safe = M(hard={"tgc": 0.5, "safety_violation_rate": 0.0}, safety={"tgc": 0.5, "safety_violation_rate": 0.2})
    d = decide(less_safe, champ, gate, {"hard": paired_delta(noisy, champ_h, n_boot=400)})
    assert not d.promote and any("safety violation rate 0.2000 > champion 0.0000" in r for r in d.reasons)


def test_phase_progress_takes_each_phases_own_held_out_numbers():
    from components.evaluation.report import phase_progress

    runs = [("sft", {"sft/easy/tgc": 0.1, "sft/train_loss": 0.5}),
            ("grpo", {"grpo/incoming/easy/tgc": 0.1, "grpo/final/easy/tgc": 0.3, "grpo/heldout/hard/tgc": 0.2,
                      "grpo/final/easy/valid_action_rate": 0.9, "grpo/reward_mean": 0.4}),
            ("dpo", {"dpo/safety/safety_violation_rate": 0.05, "dpo/incoming/safety/safety_violation_rate": 0.1}),
            ("prepare", {"prepare/fetch_seconds": 1.0})]
    assert phase_progress(runs) == {"sft": {"easy/tgc": 0.1},
                                    "grpo": {"easy/tgc": 0.3, "hard/tgc": 0.2, "easy/valid_action_rate": 0.9},
                                    "dpo": {"safety/safety_violation_rate": 0.05}}
