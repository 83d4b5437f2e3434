from __future__ import annotations

import json
import subprocess
import sys

import pytest
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
    root = spec["root"]["dag"]["tasks"]
    # the body runs inside a dsl.ExitHandler; its exit step ends the MLflow parent run whatever the outcome
    (handler,) = [n for n in root if n.startswith("exit-handler")]
    assert root["finish-run"]["dependentTasks"] == [handler]
    assert root["finish-run"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    finish_inputs = root["finish-run"]["inputs"]["parameters"]
    assert finish_inputs["kfp_run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert "status" in finish_inputs  # PipelineTaskFinalStatus
    tasks = spec["components"][root[handler]["componentRef"]["name"]]["dag"]["tasks"]
    assert tasks["configure"]["inputs"]["parameters"]["kfp_run_id"]["runtimeValue"]["constant"] == \
        "{{$.pipeline_job_uuid}}"
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
    # the console: one line per task (with its key number) and the table; kfp.local's executor logs in a file
    assert "executor_input" not in res.stdout + res.stderr
    (log,) = (tmp_path / "home" / "logs").glob("run-*.log")
    assert "executor_input" in log.read_text()
    for task in ("configure", "sandbox-build", "prepare", "sft-warmup", "grpo", "rejection-sampling", "dpo", "evaluate",
                 "finish-run"):
        assert any(line.split()[:2] == [task, "SUCCESS"] for line in res.stdout.splitlines()), (task, res.stdout)
    assert any(line.split()[:2] == ["evaluate", "SUCCESS"] and "hard_tgc=" in line for line in res.stdout.splitlines())
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
    # every MLflow run carries the KFP run's id; the exit step (dsl.ExitHandler) ended the parent with its state
    kfp_ids = {client.get_run(v["run_id"]).data.tags.get("kfp.run_id") for v in report["phases"].values()}
    assert len(kfp_ids) == 1 and None not in kfp_ids and "" not in kfp_ids
    assert client.get_run(report["parent_run_id"]).data.tags["kfp.final_state"] == "SUCCEEDED"
    assert client.get_run(report["phases"]["eval"]["run_id"]).data.tags["kfp.pipeline"] == "agentrl"


@pytest.mark.slow
def test_run_with_lora_hands_on_one_adapter_every_phase_and_the_registry_can_load(tmp_path):
    """`model.lora.enabled=true` end to end: each phase's model is the one adapter on prepare's stored base,
    named in its card, so the next phase and the registry's champion load it."""
    from components.core.policy import load_policy
    from components.core.tracking import Registry

    env = {"AGENTRL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", *QUICK, "--set", "model.lora.enabled=true",
                          "--set", "model.lora.r=4"], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    report = json.loads((tmp_path / "home" / "last_run.json").read_text())
    assert report["status"] == "FINISHED"
    (root,) = (tmp_path / "home" / "pipeline_root").iterdir()
    base = json.loads(next((root / "prepare").rglob("agentrl.json")).read_text())
    for phase in ("sft-warmup", "grpo", "rejection-sampling", "dpo"):
        card_file = next((root / phase).rglob("agentrl.json"))
        card = json.loads(card_file.read_text())
        assert card["kind"] == "lora" and (card_file.parent / "adapter_config.json").is_file(), phase
        assert card["extra"]["base_uri"] and "pipeline_root" not in card["extra"]["base_uri"], phase  # the stored base
        assert load_policy(str(card_file.parent)).is_lora
    assert base["kind"] == "full"
    champion = Registry(report["tracking_uri"]).get_alias("champion")
    if champion is not None:  # promoted (the gate's call): what the registry hands on loads as base + adapter
        import mlflow

        local = mlflow.artifacts.download_artifacts(artifact_uri=champion.source, dst_path=str(tmp_path / "champ"),
                                                    tracking_uri=report["tracking_uri"])
        assert load_policy(local).is_lora


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


def _task_processes(marker: str) -> list[int]:
    """The Python processes kfp.local started for the task whose executor input names `marker`."""
    from pathlib import Path

    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if proc.name.isdigit() and b"python" in argv[0] and any(marker.encode() in a for a in argv):
            pids.append(int(proc.name))
    return pids


@pytest.mark.slow
def test_a_phase_that_crashes_is_started_once_more_and_the_run_finishes(tmp_path):
    """The local plan retries a phase once, as the cluster's does: rejection sampling's process dies of a segfault
    (what one CI run saw, once) a few seconds in; its second attempt runs, and the run ends FINISHED."""
    import os
    import signal
    import time

    env = {"AGENTRL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", *QUICK, "--param", "run_dpo=false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    marker, killed, deadline = "/rejection-sampling/executor_output.json", None, time.monotonic() + 900
    try:
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            pids = _task_processes(marker)
            if pids:
                time.sleep(3)  # past its imports: inside the phase
                for pid in _task_processes(marker):
                    os.kill(pid, signal.SIGSEGV)
                    killed = pid
            time.sleep(0.2)
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "rejection sampling never started"
    assert proc.returncode == 0, (out + err)[-4000:]
    (log,) = (tmp_path / "home" / "logs").glob("run-*.log")
    text = log.read_text()
    assert "Segmentation fault" in text or "Fatal Python error" in text  # the first attempt's end is in the log
    report = json.loads((tmp_path / "home" / "last_run.json").read_text())
    assert report["status"] == "FINISHED" and report["phases"]["rejection_sampling"]["status"] == "FINISHED"
    assert "gain/hard/tgc" in report["metrics"]["rejection_sampling"]
    assert report["phases"]["eval"]["status"] == "FINISHED"
