"""`agentrl learn`: paired gains over seeds and tasks with bootstrap intervals, learning.json, the README's table."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from pipelines import learn
from tests.pipelines.test_cli import QUICK


def _rows(successes, level=3, hard=None):
    return [{"task": f"t{i:03d}", "level": level, "success": s, "hard": (hard or [0] * len(successes))[i],
             "steps": 2, "tokens": 10} for i, s in enumerate(successes)]


def _outcome(seed, per_phase, dpo=None):
    return {"seed": seed, "parent_run_id": f"run{seed}", "dpo_pairs": dpo or {},
            "models": {p: {s: _rows(v) for s, v in suites.items()} for p, suites in per_phase.items()}}


def test_bootstrap_of_a_constant_difference_is_that_difference():
    b = learn.bootstrap_mean([[1.0] * 20, [1.0] * 20, [1.0] * 20], n_boot=200)
    assert b == {"mean": 1.0, "ci_low": 1.0, "ci_high": 1.0, "se": 0.0}


def test_bootstrap_interval_holds_the_mean_narrows_with_tasks_and_widens_with_seed_noise():
    rng = random.Random(1)
    small = [[float(rng.random() < 0.5) for _ in range(20)] for _ in range(3)]
    large = [[float(rng.random() < 0.5) for _ in range(400)] for _ in range(3)]
    a, b = learn.bootstrap_mean(small, 500), learn.bootstrap_mean(large, 500)
    assert a["ci_low"] < a["mean"] < a["ci_high"] and b["ci_low"] < b["mean"] < b["ci_high"]
    assert (b["ci_high"] - b["ci_low"]) < (a["ci_high"] - a["ci_low"]) / 2
    # seeds that disagree (one learned, two did not) widen the interval beyond what tasks alone give
    mixed = learn.bootstrap_mean([[1.0] * 400, [0.0] * 400, [0.0] * 400], 500)
    assert mixed["ci_low"] == 0.0 and mixed["ci_high"] == 1.0
    with pytest.raises(ValueError, match="same 20 tasks"):
        learn.bootstrap_mean([[0.0] * 20, [0.0] * 19])


def test_sensitivity_says_what_a_suite_can_tell_from_zero():
    # 1 task in 10 changed, half up, half down, on 120 tasks (one seed): the error of the mean is ~sqrt(0.1/120)
    rng = random.Random(3)
    diffs = [[rng.choice([1.0, -1.0]) if rng.random() < 0.1 else 0.0 for _ in range(120)]]
    s = learn.sensitivity(diffs, learn.bootstrap_mean(diffs, 2000)["se"])
    changed = sum(x != 0 for x in diffs[0])
    assert s["discordant"] == round(changed / 120, 4)
    assert s["min_detectable_gain"] == pytest.approx(learn.DETECT_Z * (changed / 120 / 120) ** 0.5, rel=0.15)
    # 5 points need more tasks than 120 at this discordance, and 4x the tasks halve the detectable gain
    assert s["tasks_for_target"] > 120
    big = [diffs[0] * 4]  # the same discordance on 480 tasks
    s4 = learn.sensitivity(big, learn.bootstrap_mean(big, 2000)["se"])
    assert s4["min_detectable_gain"] == pytest.approx(s["min_detectable_gain"] / 2, rel=0.15)
    assert s4["tasks_for_target"] == pytest.approx(s["tasks_for_target"], rel=0.3)
    # seeds that disagree widen the error beyond what the tasks give: more tasks is then a floor, not enough
    split = [[1.0 if i < 12 else 0.0 for i in range(120)], [0.0] * 120, [-1.0 if i < 12 else 0.0 for i in range(120)]]
    one = [[x for row in split for x in row]]  # the same 360 outcomes taken as one seed's tasks
    assert learn.sensitivity(split, learn.bootstrap_mean(split, 2000)["se"])["min_detectable_gain"] > \
        1.5 * learn.sensitivity(one, learn.bootstrap_mean(one, 2000)["se"])["min_detectable_gain"]
    # nothing changed: no size is implied
    assert learn.sensitivity([[0.0] * 40] * 3, 0.0) == {"discordant": 0.0, "min_detectable_gain": None,
                                                         "tasks_for_target": None}


def test_summary_pairs_each_phase_with_its_incoming_model():
    # sft solves 3 of 4 more than the base on easy; grpo one fewer on hard in seed 1 only
    outcomes = [
        _outcome(0, {"prepare": {"easy": [0, 0, 0, 0], "hard": [0, 0, 0, 0], "safety": [1, 1]},
                     "sft": {"easy": [1, 1, 1, 0], "hard": [1, 0, 0, 0], "safety": [1, 1]},
                     "grpo": {"easy": [1, 1, 1, 0], "hard": [1, 0, 0, 0], "safety": [1, 1]}},
                 dpo={"accuracy": 0.75, "n_heldout": 20}),
        _outcome(1, {"prepare": {"easy": [0, 0, 0, 0], "hard": [0, 0, 0, 0], "safety": [1, 1]},
                     "sft": {"easy": [1, 1, 1, 0], "hard": [1, 1, 0, 0], "safety": [1, 1]},
                     "grpo": {"easy": [1, 1, 1, 0], "hard": [1, 0, 0, 0], "safety": [1, 1]}},
                 dpo={"accuracy": 0.5, "n_heldout": 12}),
    ]
    s = learn.summarize(outcomes, n_boot=300)
    assert s["sft"]["easy"]["gain"] == 0.75 and s["sft"]["easy"]["n_tasks"] == 4 and s["sft"]["easy"]["seeds"] == 2
    assert s["grpo"]["hard"]["gain"] == -0.125 and s["grpo"]["easy"]["gain"] == 0.0
    assert s["grpo"]["hard"]["ci_low"] <= -0.125 <= s["grpo"]["hard"]["ci_high"]
    assert s["grpo"]["hard"]["discordant"] == 0.125 and s["grpo"]["easy"]["min_detectable_gain"] is None
    assert s["sft"]["easy"]["min_detectable_gain"] > 0 and s["sft"]["easy"]["tasks_for_target"] > 4
    assert "rejection_sampling" not in s  # not measured: no gain claimed
    assert s["tgc"]["sft"]["hard"]["value"] == 0.375 and s["levels"]["sft"] == {"3": 0.375}
    assert s["dpo"]["pairs"]["n_heldout"] == 32 and s["dpo"]["pairs"]["accuracy"] == pytest.approx(21 / 32)
    assert s["meta"]["seeds"] == [0, 1] and s["meta"]["suites"] == ["easy", "hard", "safety"]
    assert s["cost"]["sft"]["easy"]["tokens_per_task"]["value"] == 10 and s["cost"]["sft"]["easy"]["steps_per_task"] == 2
    assert s["cost"]["sft"]["safety"]["sgc"] == 1.0 and s["cost"]["prepare"]["easy"]["sgc"] == 0.0


def test_the_table_is_written_between_the_markers_and_nowhere_else(tmp_path):
    outcomes = [_outcome(0, {"prepare": {"easy": [0, 0], "hard": [0, 0]}, "sft": {"easy": [1, 0], "hard": [0, 0]}})]
    s = learn.summarize(outcomes, n_boot=50)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{learn.TABLE_START}\nold table\n{learn.TABLE_END}\nafter\n")
    learn.write_table(s, readme)
    text = readme.read_text()
    assert text.startswith("# x\nbefore\n") and text.endswith(f"{learn.TABLE_END}\nafter\n")
    assert "old table" not in text and "| sft | +50.0 [" in text
    assert "smallest detectable gain" in text and "| sft | " in text.split("smallest detectable gain")[-1]
    learn.write_table(s, readme)
    assert readme.read_text() == text  # the same learning.json, the same file
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="plain.md: expected the markers"):
        learn.write_table(s, tmp_path / "plain.md")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a pipeline run and four measurements; each subprocess has its own bound below
def test_learn_runs_a_seed_measures_its_chain_and_reuses_what_it_measured(tmp_path):
    """`agentrl learn` on small budgets: one seed's pipeline, every model of the chain measured task by task."""
    home = tmp_path / "home"
    env = {"AGENTRL_HOME": str(home), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "pipelines.cli", "learn", "--seed-list", "3", "--quiet", "--bootstrap", "100", *QUICK]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    learning = json.loads((home / "learning.json").read_text())
    for phase in learn.GAIN_PHASES:
        for suite in ("easy", "hard", "safety", "robustness"):
            g = learning[phase][suite]
            assert g["n_tasks"] == 4 and g["seeds"] == 1 and g["ci_low"] <= g["gain"] <= g["ci_high"], (phase, g)
    outcome = json.loads((home / "learning" / "seed-3" / "outcomes.json").read_text())
    assert set(outcome["models"]) == {"prepare", "sft", "grpo", "rejection_sampling", "dpo"}
    assert outcome["seed"] == 3 and outcome["model_uris"]["dpo"].endswith("/dpo/model")
    # the measurement is the eval phase's: the final model's easy TGC equals what the pipeline's evaluation logged
    report = json.loads((home / "last_run.json").read_text())
    easy = [r["success"] for r in outcome["models"]["dpo"]["easy"]]
    assert sum(easy) / len(easy) == pytest.approx(report["metrics"]["eval"]["easy/tgc"])
    assert "| grpo |" in res.stdout
    # again: nothing re-run (the seed's outcomes are reused), the same learning.json; other overrides are refused
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "measured already" in again.stdout, again.stderr[-2000:]
    assert json.loads((home / "learning.json").read_text())["sft"] == learning["sft"]
    other = subprocess.run([*cmd, "--set", "grpo.steps=3"], capture_output=True, text=True, env=env, timeout=300)
    assert other.returncode == 2 and "run with preset" in other.stderr
    # another measurement of the same run (larger held-out suites): measured again, not run again
    larger = subprocess.run([*cmd, "--eval-set", "sandbox.suite_sizes={easy: 7, hard: 4, safety: 4, robustness: 4}"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert larger.returncode == 0 and "measured again" in larger.stdout, larger.stderr[-2000:]
    assert "pipeline FINISHED" not in larger.stdout
    again = json.loads((home / "learning.json").read_text())
    assert again["sft"]["easy"]["n_tasks"] == 7 and again["sft"]["hard"] == learning["sft"]["hard"]
    # one phase again on what the seed's run handed it: rejection sampling from its GRPO model, then the pairing
    variant = subprocess.run([sys.executable, "-m", "pipelines.phase_variants", "rejection_sampling", "--home", str(home),
                              "--seed", "3", "--name", "wide", "--set", "rejection_sampling.hard_success_max=1.0"],
                             capture_output=True, text=True, env=env, timeout=600)
    assert variant.returncode == 0, (variant.stdout + variant.stderr)[-4000:]
    line = json.loads((home / "phase_variants.jsonl").read_text().splitlines()[-1])
    assert line["phase"] == "rejection_sampling" and line["incoming"] == outcome["model_uris"]["grpo"]
    assert line["hard_tasks"] >= line["kept"] > 0 or line["hard_tasks"] == line["kept"] == 0, line
    tasks = json.loads((home / "variants" / "rejection_sampling-seed3-wide" / "tasks.json").read_text())
    assert set(tasks) == {"easy", "hard", "safety"} and len(tasks["hard"]) == 4
    paired = subprocess.run([sys.executable, "-m", "pipelines.phase_variants", "compare", "--home", str(home), "--seed",
                             "3", "--phase", "rejection_sampling", "@grpo", "wide"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert paired.returncode == 0, paired.stderr[-2000:]
    hard = json.loads(paired.stdout)["suites"]["hard"]["success"]
    grpo = {r["task"]: r["success"] for r in json.loads((home / "learning" / "seed-3" / "outcomes.json").read_text())[
        "models"]["grpo"]["hard"]}
    mine = {r["task"]: r["success"] for r in tasks["hard"]}
    assert hard["a"] == pytest.approx(sum(grpo[t] for t in mine) / 4)
    assert hard["b"] == pytest.approx(sum(mine.values()) / 4)
    # what RL can lift: each task's greedy outcome (as measured above) beside k sampled attempts
    head = subprocess.run([sys.executable, "-m", "pipelines.headroom", "--home", str(home), "--seed", "3", "--models",
                           "sft,grpo", "--samples", "2", "--suites", "easy,hard"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert head.returncode == 0, (head.stdout + head.stderr)[-4000:]
    room = json.loads((home / "learning" / "seed-3" / "headroom-T1.json").read_text())
    measured = json.loads((home / "learning" / "seed-3" / "outcomes.json").read_text())["models"]
    for name in ("sft", "grpo"):
        for suite in ("easy", "hard"):
            r = room["models"][name][suite]
            greedy = {x["task"]: x["success"] for x in measured[name][suite]}
            assert r["greedy_solved"] == sum(greedy[t] for t in r["per_task"]) and r["tasks"] == len(r["per_task"])
            assert all(v["sampled"] in (0, 0.5, 1) for v in r["per_task"].values())
    assert "sampled_gain_over_sft" in room["models"]["grpo"]["hard"] and "sampled success grpo - sft" in head.stdout


def test_phase_variants_needs_a_learn_run_and_a_valid_variant(tmp_path, capsys, monkeypatch):
    from pipelines import phase_variants

    monkeypatch.setenv("AGENTRL_HOME", str(tmp_path / "unchanged"))

    assert phase_variants.main(["dpo", "--home", str(tmp_path), "--name", "x"]) == 2
    assert "learning/seed-0/run.json: not found" in capsys.readouterr().err
    seed = tmp_path / "learning" / "seed-0"
    seed.mkdir(parents=True)
    (seed / "run.json").write_text(json.dumps({"preset": "tiny", "overrides": [], "parent_run_id": "r"}))
    from components.core.config import ConfigError

    with pytest.raises(ConfigError, match="dpo.sft_weight"):  # a bad variant fails before any work
        phase_variants.main(["dpo", "--home", str(tmp_path), "--name", "x", "--set", "dpo.sft_weight=-1"])
    with pytest.raises(ConfigError, match="rejection_sampling.top_k"):
        phase_variants.main(["rejection_sampling", "--home", str(tmp_path), "--name", "x",
                             "--set", "rejection_sampling.top_k=99"])
    assert os.environ["AGENTRL_HOME"] == str(tmp_path / "unchanged")


def test_phase_variants_compare_pairs_runs_and_tasks(tmp_path, capsys):
    from pipelines import phase_variants

    def write(name, success, tokens, skill):
        rows = [{"task": f"t{i}", "scenario": f"s{i // 2}", "level": 1, "success": s, "hard": 0, "steps": 2,
                 "tokens": k, "skill": u} for i, (s, k, u) in enumerate(zip(success, tokens, skill, strict=True))]
        d = tmp_path / "variants" / f"grpo-seed0-{name}"
        d.mkdir(parents=True)
        (d / "tasks.json").write_text(json.dumps({"easy": rows}))

    write("a0", [1, 0, 1, 0], [10, 10, 10, 10], [0, 0, 0, 0])
    write("b0", [1, 1, 1, 1], [6, 6, 6, 6], [0, 1, 0, 1])
    write("a1", [1, 1, 0, 0], [10, 10, 10, 10], [0, 0, 0, 0])
    write("b1", [1, 1, 0, 0], [8, 8, 8, 8], [0, 0, 0, 0])
    assert phase_variants.main(["compare", "--home", str(tmp_path), "a0,a1", "b0,b1"]) == 0
    easy = json.loads(capsys.readouterr().out)["suites"]["easy"]
    assert easy["success"]["a"] == 0.5 and easy["success"]["b"] == 0.75 and easy["success"]["diff"] == 0.25
    assert 0.0 <= easy["success"]["ci_low"] <= 0.25 < easy["success"]["ci_high"]  # no task got worse: no draw below 0
    assert easy["tokens"]["diff"] == -3.0 and -4.0 <= easy["tokens"]["ci_low"] <= easy["tokens"]["ci_high"] <= -2.0
    assert easy["skill"]["b"] == 0.25
    # SGC: scenarios s0 (t0, t1) and s1 (t2, t3); a0 solves neither whole, b0 both; a1 s0, b1 s0
    assert easy["sgc"]["a"] == 0.25 and easy["sgc"]["b"] == 0.75 and easy["sgc"]["diff"] == 0.5
    assert phase_variants.main(["compare", "--home", str(tmp_path), "a0,a1", "b0"]) == 2
    assert "as many runs of A as of B" in capsys.readouterr().err
    assert phase_variants.main(["compare", "--home", str(tmp_path), "a0", "zz"]) == 2
    assert "grpo-seed0-zz/tasks.json: not found" in capsys.readouterr().err
    # @sft: the incoming model as `agentrl learn` measured it (no skill key there), paired with a variant
    assert phase_variants.main(["compare", "--home", str(tmp_path), "@sft", "b0"]) == 2
    assert "seed-0/outcomes.json: not found" in capsys.readouterr().err
    sft_rows = [{"task": f"t{i}", "scenario": f"s{i // 2}", "level": 1, "success": s, "hard": 0, "steps": 3, "tokens": 9}
                for i, s in enumerate([0, 0, 1, 0])]
    (tmp_path / "learning" / "seed-0").mkdir(parents=True)
    (tmp_path / "learning" / "seed-0" / "outcomes.json").write_text(json.dumps({"models": {"sft": {"easy": sft_rows}}}))
    assert phase_variants.main(["compare", "--home", str(tmp_path), "@sft", "b0"]) == 0
    easy = json.loads(capsys.readouterr().out)["suites"]["easy"]
    assert easy["success"]["a"] == 0.25 and easy["success"]["diff"] == 0.75 and easy["tokens"]["diff"] == -3.0
    assert easy["skill"]["a"] == 0.0 and easy["skill"]["diff"] == 0.5
    assert phase_variants.main(["compare", "--home", str(tmp_path), "@dpo", "b0"]) == 2
    assert "expected @ and one of ['sft']" in capsys.readouterr().err


def test_headroom_summarizes_greedy_beside_sampled_and_refuses_bad_input(tmp_path, capsys):
    from pipelines import headroom

    r = headroom.summarize([1, 0, 0, 1], [0.5, 0.0, 0.25, 1.0], n_boot=50)
    assert r["tasks"] == 4 and r["greedy_solved"] == 2 and r["failed_any_sample"] == 1
    assert r["sampled_rate_on_failed"] == 0.125 and r["sampled_rate_on_solved"] == 0.75
    assert r["sampled_success"]["value"] == pytest.approx(0.4375)
    assert r["sampled_success"]["ci"][0] <= 0.4375 <= r["sampled_success"]["ci"][1]
    with pytest.raises(ValueError, match="one sampled rate per greedy outcome"):
        headroom.summarize([1, 0], [0.5])
    assert headroom.main(["--home", str(tmp_path)]) == 2
    assert "outcomes.json: not found" in capsys.readouterr().err
    seed = tmp_path / "learning" / "seed-0"
    seed.mkdir(parents=True)
    (seed / "run.json").write_text(json.dumps({"preset": "tiny", "overrides": [], "parent_run_id": "r"}))
    (seed / "outcomes.json").write_text(json.dumps({"model_uris": {"sft": "/nowhere"}, "models": {}}))
    assert headroom.main(["--home", str(tmp_path), "--models", "sft,grpo"]) == 2
    assert "--models ['grpo']: expected some of ['sft']" in capsys.readouterr().err
    assert headroom.main(["--home", str(tmp_path), "--samples", "0"]) == 2
