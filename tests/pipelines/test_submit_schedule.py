"""`agentrl submit | schedule | compare` against a local server that records the KFP API requests
(no KFP backend runs here), and the retraining pipeline's shape."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines.cli import cron_to_kfp, main
from tests.helpers.kfp_api import KFPRecorder
from tests.pipelines.test_placement import all_tasks


def _posts(k: KFPRecorder, suffix: str) -> list[dict]:
    return [r["body"] for r in k.requests if r["method"] == "POST" and r["path"].endswith(suffix)]


def test_submit_sends_the_compiled_pipeline_with_parameters_and_placement():
    with KFPRecorder() as k:
        assert main(["submit", "--host", k.url, "--param", "dpo_ab_logs_uri=s3://b/ab/", "--run-name", "nightly",
                     "--param", "base_model_uri=s3://b/models/base/", "--param", "grpo_steps=50",
                     "--param", "sage=true", "--param", "eval_suites=[easy, hard]", "--param", "grpo_learning_rate=2e-6",
                     "--param", "run_dpo=false", "--overrides", '{"sft": {"epochs": 1}}']) == 0
    (run,) = _posts(k, "/apis/v2beta1/runs")
    assert run["display_name"] == "nightly"
    # typed values reach KFP as the run form's types, not as text
    assert run["runtime_config"]["parameters"] == {
        "dpo_ab_logs_uri": "s3://b/ab/", "base_model_uri": "s3://b/models/base/", "grpo_steps": 50, "sage": True,
        "eval_suites": ["easy", "hard"], "grpo_learning_rate": 2e-6, "run_dpo": False,
        "overrides": '{"sft": {"epochs": 1}}'}
    spec, platform = run["pipeline_spec"]["pipeline_spec"], run["pipeline_spec"]["platform_spec"]
    assert spec["pipelineInfo"]["name"] == "agentrl"
    assert {"sft-warmup", "rejection-sampling", "dpo", "evaluate"} <= set(all_tasks(spec))
    sft = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-sft-warmup"]
    assert sft["nodeSelector"]["labels"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    (exp,) = _posts(k, "/apis/v2beta1/experiments")
    assert exp["display_name"] == "agentrl" and run["experiment_id"]


@pytest.mark.parametrize("cron,expected", [("0 3 * * 1", "0 0 3 * * 1"), ("*/15 * * * *", "0 */15 * * * *"),
                                           ("30 0 3 * * 1", "30 0 3 * * 1")])
def test_schedule_converts_cron_and_reuses_the_experiment(cron, expected):
    with KFPRecorder() as k:
        assert main(["submit", "--host", k.url]) == 0  # creates the experiment
        assert main(["schedule", "--host", k.url, "--cron", cron, "--param", "ab_logs_uri=s3://b/ab/"]) == 0
    (job,) = _posts(k, "/apis/v2beta1/recurringruns")
    assert job["trigger"] == {"cron_schedule": {"cron": expected}}
    assert job["max_concurrency"] == 1 and job["no_catchup"] is True and job["mode"] == "ENABLE"
    assert job["runtime_config"]["parameters"] == {"ab_logs_uri": "s3://b/ab/"}
    assert job["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "agentrl-retrain"
    assert len(_posts(k, "/apis/v2beta1/experiments")) == 1
    assert job["experiment_id"] == _posts(k, "/apis/v2beta1/runs")[0]["experiment_id"]


def test_bad_input_is_refused_before_anything_is_sent(capsys):
    with KFPRecorder() as k:
        assert main(["schedule", "--host", k.url, "--cron", "0 3 * *"]) == 2
        assert "expected 5 fields" in capsys.readouterr().err
        assert main(["submit", "--host", k.url, "--overrides", "{not json"]) == 2
        assert main(["submit", "--host", k.url, "--param", "novalue"]) == 2
        assert "NAME=VALUE" in capsys.readouterr().err
        assert main(["submit", "--host", k.url, "--param", "grpo_steps=many"]) == 2
        assert "grpo_steps=many: expected int" in capsys.readouterr().err
        assert main(["submit", "--host", k.url, "--param", "grpo_stepz=5"]) == 2
        assert "not a parameter of agent_rl" in capsys.readouterr().err
    assert k.requests == []
    with pytest.raises(ValueError):
        cron_to_kfp("* * *")


def test_retrain_pipeline_shape(tmp_path):
    assert main(["compile", "--pipeline", "retrain", "-o", str(tmp_path / "r.yaml")]) == 0
    spec = next(yaml.safe_load_all((tmp_path / "r.yaml").read_text()))
    root = spec["root"]["dag"]["tasks"]
    # the body inside a dsl.ExitHandler whose exit step ends the MLflow parent run
    assert set(root) == {"exit-handler-1", "finish-run"} and root["finish-run"]["dependentTasks"] == ["exit-handler-1"]
    comps = spec["components"]
    tasks = comps[root["exit-handler-1"]["componentRef"]["name"]]["dag"]["tasks"]
    (cond,) = [n for n in tasks if n.startswith("condition-branches")]
    assert set(tasks) == {"configure", "sandbox-build", "champion", cond}
    assert sorted(tasks[cond]["dependentTasks"]) == ["champion", "configure", "sandbox-build"]
    branches = [set(comps[f"comp-{b}"]["dag"]["tasks"]) for b in comps[f"comp-{cond}"]["dag"]["tasks"]]
    # with the refresh: grpo -> dpo -> evaluate (-> promote); without: dpo -> evaluate (-> promote)
    assert sorted(sorted(t for t in b if not t.startswith("condition")) for b in branches) == [
        ["dpo", "evaluate", "grpo"], ["dpo-2", "evaluate-2"]]
    refresh = next(comps[f"comp-{b}"]["dag"]["tasks"] for b in comps[f"comp-{cond}"]["dag"]["tasks"]
                   if "grpo" in comps[f"comp-{b}"]["dag"]["tasks"])
    assert "grpo" in refresh["dpo"]["dependentTasks"]
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["grpo_refresh"]["defaultValue"] is False
    assert "ab_logs_uri" in spec["root"]["inputDefinitions"]["parameters"]
    assert "isOptional" not in spec["root"]["inputDefinitions"]["parameters"]["ab_logs_uri"]


def test_compare_prints_runs_side_by_side(tmp_path, capsys, monkeypatch):
    from components.core.tracking import PhaseRun, start_pipeline_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("AGENTRL_HOME", str(tmp_path))
    ids = []
    for tgc in (0.25, 0.5):
        parent = start_pipeline_run(uri, "agentrl", "run")
        with PhaseRun("eval", parent_run_id=parent, tracking_uri=uri, close_parent=True) as run:
            run.log_metrics({"easy/tgc": tgc}, step=0)
        ids.append(parent)
    assert main(["compare", *ids, "--metric", "easy/tgc", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "eval/easy/tgc" in out and "0.25" in out and "0.5" in out
    runs = json.loads((tmp_path / "c.json").read_text())["runs"]
    assert [runs[i]["eval"]["metrics"]["easy/tgc"] for i in ids] == [0.25, 0.5]


def test_upload_creates_pipelines_then_versions_and_schedule_replaces_itself():
    with KFPRecorder() as k:
        assert main(["upload", "--host", k.url]) == 0
        assert main(["upload", "--host", k.url, "--pipeline", "retrain", "--version", "v2"]) == 0
        assert main(["schedule", "--host", k.url, "--cron", "0 3 * * 1", "--param", "ab_logs_uri=s3://b/ab/"]) == 0
        assert main(["schedule", "--host", k.url, "--cron", "0 4 * * 1", "--param", "ab_logs_uri=s3://b/ab/"]) == 0
    uploads = [r for r in k.requests if r["path"] == "/apis/v2beta1/pipelines/upload"]
    assert [r["query"]["name"] for r in uploads] == [["agentrl-agent-rl"], ["agentrl-retrain"]]
    assert "filename=\"agent_rl.yaml\"" in uploads[0]["body"] and "sft-warmup" in uploads[0]["body"]
    (version,) = [r for r in k.requests if r["path"] == "/apis/v2beta1/pipelines/upload_version"]
    assert version["query"]["name"] == ["v2"] and "agentrl-retrain" in version["body"]
    deletes = [r for r in k.requests if r["method"] == "DELETE"]
    assert len(deletes) == 1 and len(k.recurring) == 1  # one schedule per name
    (job,) = k.recurring.values()
    assert job["trigger"]["cron_schedule"]["cron"] == "0 0 4 * * 1"
