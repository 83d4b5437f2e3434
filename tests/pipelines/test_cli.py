from __future__ import annotations

import json
import subprocess
import sys

import yaml

from pipelines.cli import main


def test_config_prints_resolved_and_rejects_typos(capsys):
    assert main(["config", "--set", "grpo.group_size=6"]) == 0
    assert json.loads(capsys.readouterr().out)["grpo"]["group_size"] == 6
    assert main(["config", "--set", "grpo.grup_size=6"]) == 2
    assert "did you mean 'group_size'" in capsys.readouterr().err


def _switched_phase(spec: dict, branches: str) -> tuple[str, str]:
    """(the phase task, the pass-through task) of a `condition-branches-N` task of the root DAG."""
    conditions = spec["components"][f"comp-{branches}"]["dag"]["tasks"]
    inner = [t for c in conditions.values() for t in spec["components"][c["componentRef"]["name"]]["dag"]["tasks"]]
    phase = [t for t in inner if not t.startswith("skip-phase")]
    skip = [t for t in inner if t.startswith("skip-phase")]
    assert len(phase) == len(skip) == 1, inner
    return phase[0], skip[0]


def test_compile_writes_a_pipeline_with_documented_parameters(tmp_path):
    out = tmp_path / "p.yaml"
    assert main(["compile", "-o", str(out)]) == 0
    docs = list(yaml.safe_load_all(out.read_text()))
    spec = docs[0]
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"base_model_uri", "preset", "overrides", "experiment", "parent_run_id", "dpo_ab_logs_uri"} <= set(params)
    tasks = spec["root"]["dag"]["tasks"]
    # configure -> sandbox-build -> prepare -> [sft | skip] -> [grpo | skip] -> [rs | skip] -> [dpo | skip] -> evaluate
    assert "dependentTasks" not in tasks["configure"]
    assert tasks["sandbox-build"]["dependentTasks"] == ["configure"]
    assert sorted(tasks["prepare"]["dependentTasks"]) == ["configure", "sandbox-build"]
    order, previous = [], "prepare"
    for _ in range(4):
        (branches,) = [n for n, t in tasks.items() if n.startswith("condition-branches")
                       and previous in t.get("dependentTasks", [])]
        order.append(_switched_phase(spec, branches)[0])
        previous = branches
    assert order == ["sft-warmup", "grpo", "rejection-sampling", "dpo"]
    assert previous in tasks["evaluate"]["dependentTasks"]
    gate = [t for n, t in tasks.items() if n.startswith("condition-") and not n.startswith("condition-branches")]
    assert len(gate) == 1 and "evaluate-promote" in json.dumps(gate[0]["triggerPolicy"])
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    # the default plan is h100: the phases that generate run in the image with vLLM
    assert images == {"ghcr.io/agentrl/trainer:0.1.0", "ghcr.io/agentrl/rollout:0.1.0", "ghcr.io/agentrl/sandbox:0.1.0"}


QUICK = ["--set", "sft.max_minutes=0.25", "--set", "eval.pass_k=2", "--set", "eval.bootstrap_samples=50",
         "--set", "sandbox.max_turns=3", "--set", "generation.max_new_tokens=24",
         "--set", "sandbox.suite_sizes={easy: 4, hard: 4, safety: 4, robustness: 4}",
         "--set", "rejection_sampling.probe_tasks=4", "--set", "rejection_sampling.probe_samples=2",
         "--set", "rejection_sampling.num_samples=2", "--set", "rejection_sampling.top_k=1",
         "--set", "dpo.simulate.requests=8", "--set", "dpo.min_pairs=2", "--set", "dpo.epochs=1",
         "--set", "grpo.steps=2", "--set", "grpo.tasks_per_step=2", "--set", "grpo.group_size=2",
         "--set", "grpo.eval_max_tasks=2", "--set", "model.tiny.pretrain_steps=20"]


def test_run_locally_through_kfp_local(tmp_path):
    """`agentrl run` end to end on the embedded default (what `make run` does), with small budgets."""
    env = {"AGENTRL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", *QUICK], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    report = json.loads((tmp_path / "home" / "last_run.json").read_text())
    assert report["status"] == "FINISHED"
    assert report["phases"]["prepare"]["status"] == "FINISHED"
    assert report["phases"]["sandbox_build"]["status"] == "FINISHED"
    assert report["metrics"]["sandbox_build"]["expert_success_easy_json"] == 1.0
    assert report["phases"]["sft"]["status"] == report["phases"]["eval"]["status"] == "FINISHED"
    assert "easy/tgc" in report["metrics"]["sft"] and "hard/tgc" in report["metrics"]["eval"]
    assert report["metrics"]["eval"]["gate/promote"] in (0.0, 1.0)
    assert report["phases"]["rejection_sampling"]["status"] == report["phases"]["dpo"]["status"] == "FINISHED"
    assert "gain/hard/tgc" in report["metrics"]["rejection_sampling"]
    assert report["phases"]["grpo"]["status"] == "FINISHED"
    assert {"final/easy/tgc", "final/hard/tgc", "incoming/easy/tgc", "reward_mean"} <= set(report["metrics"]["grpo"])
    assert report["metrics"]["dpo"]["pairs_train"] >= 2 and "safety/safety_violation_rate" in report["metrics"]["dpo"]
    assert report["metrics"]["prepare"]["smoke_new_tokens"] == 16
    assert 2e6 < report["metrics"]["prepare"]["base_parameters"] < 1e7
    from mlflow import MlflowClient

    client = MlflowClient(report["tracking_uri"])
    assert client.get_run(report["parent_run_id"]).info.status == "FINISHED"
    # the report is logged as report.html (MLflow's artifact viewer renders it); nothing was left unsent
    names = {a.path for a in client.list_artifacts(report["phases"]["eval"]["run_id"])}
    assert {"report.html", "metrics.json"} <= names, names
    assert report["tracking_buffered"] == {}
    assert not list((tmp_path / "home" / "metric_buffer").glob("*.jsonl"))


def test_run_with_a_bad_override_fails_before_any_work(tmp_path):
    env = {"AGENTRL_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", "--set", "sft.learning_rate=-1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2 and "sft.learning_rate = -1" in res.stderr
    assert not (tmp_path / "home" / "pipeline_root").exists()


def test_a_failing_component_reports_its_own_error(tmp_path):
    env = {"AGENTRL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", *QUICK, "--set",
                          f"model.base_uri={tmp_path}/no-such-model"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 1
    tail = res.stderr.strip().splitlines()[-1]
    assert tail.startswith("agentrl run: phase prepare failed:") and f"{tmp_path}/no-such-model" in tail
    report = json.loads((tmp_path / "home" / "last_run.json").read_text())
    assert report["status"] == "FAILED" and report["phases"]["prepare"]["status"] == "FAILED"
    assert "no-such-model" in report["phases"]["prepare"]["error"]
