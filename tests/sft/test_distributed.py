"""The SFT phase over two processes with torchrun (gloo on CPU): the path a multi-GPU pod takes."""

from __future__ import annotations

import json

import pytest

from components.core.config import load_config
from components.core.policy import load_policy
from components.core.schema import write_jsonl
from components.core.tiny import build_tiny_model
from components.sandbox import expert
from components.sandbox.recipe import corpus_lines
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import generate_world
from components.sft.recipe import launch
from tests.helpers.runtime import sft_inputs

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("deepspeed", [None, "zero3"])
def test_sft_over_two_processes_with_torchrun(tmp_path, monkeypatch, deepspeed):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU (gloo); a GPU pod uses cuda/nccl
    home = tmp_path / "home"
    overrides = {"run": {"home": str(home)}, "sft": {"epochs": 1, "batch_size": 2, "max_minutes": None, "deepspeed": deepspeed,
                                                     "eval_suites": [], "logging_steps": 1},
                 "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128, "pretrain_steps": 0}}}
    _, base = sft_inputs(tmp_path, load_config(overrides_json=json.dumps(overrides)))
    res = launch(processes=2, overrides=json.dumps(overrides), base_model=str(base), demos=str(tmp_path / "demos"),
                          model_out=str(tmp_path / "out"))
    assert res.metrics["world_size"] == 2.0
    assert res.metrics["deepspeed"] == float(deepspeed is not None)
    assert res.metrics["train_steps"] == 4  # 16 examples / (2 per device x 2 processes)
    pol = load_policy(str(tmp_path / "out"))
    assert pol.card is not None and pol.card.phase == "sft"
    from mlflow import MlflowClient

    runs = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").search_runs(
        [MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_experiment_by_name("agentrl").experiment_id],
        filter_string="tags.`agentrl.phase` = 'sft'")
    assert len(runs) == 1  # only rank 0 tracked


def test_sft_as_a_multi_node_job_with_inputs_staged_on_s3(tmp_path, monkeypatch, bucket, s3_endpoint):
    """sft.multi_node: the step stages its inputs on S3, launches the job (run here for real by the recording
    Kubernetes API server), follows it, and reads the stored model back."""
    import os

    from tests.helpers.k8s_api import K8sRecorder

    home = tmp_path / "home"
    overrides = {"run": {"home": str(home)}, "storage": {"root": f"s3://{bucket}/runs"},
                 "sft": {"epochs": 1, "batch_size": 4, "max_minutes": None, "eval_suites": [], "logging_steps": 1,
                         "multi_node": {"enabled": True, "num_nodes": 1, "gpus_per_node": 0, "namespace": "ml",
                                        "poll_s": 0.2}},
                 "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128, "pretrain_steps": 0}}}
    cfg = load_config(overrides_json=json.dumps(overrides))
    world = generate_world(cfg.sandbox)
    tasks = generate_tasks(world, cfg.sandbox)["train"][:8]
    demos = [expert.solve_json(WorkspaceEnv(world, cfg.sandbox), t)[0] for t in tasks]
    write_jsonl(tmp_path / "demos" / "train.jsonl", demos)
    base = build_tiny_model(tmp_path / "base", cfg.model.tiny, corpus_lines(world, demos), seed=0)
    tracking = f"sqlite:///{home / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    job_env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                            "AWS_DEFAULT_REGION", "HF_HUB_OFFLINE", "PYTHONPATH")}
    job_env["PYTHONPATH"] = os.getcwd()
    job_env["AGENTRL_HOME"] = str(tmp_path / "job-home")  # the job's pod has its own disk
    with K8sRecorder(execute_env=job_env) as k:
        from components.core import launch as jobs

        real = jobs.JobLauncher

        def launcher(cfg, api_client=None, out=print):
            return real(cfg, api_client=k.api_client(), out=out)

        monkeypatch.setattr(jobs, "JobLauncher", launcher)
        res = launch(overrides=json.dumps(overrides), base_model=str(base), demos=str(tmp_path / "demos"),
                     model_out=str(tmp_path / "out"))
    (create,) = [r for r in k.requests if r["method"] == "POST"]
    remote = json.loads(create["body"]["spec"]["trainer"]["command"][create["body"]["spec"]["trainer"]["command"]
                                                                      .index("--args") + 1])
    assert remote["base_model"].startswith(f"s3://{bucket}/runs/multi-node/") and remote["demos"].startswith("s3://")
    assert res.metrics["train_steps"] == 2 and res.model_uri.startswith(f"s3://{bucket}/")
    pol = load_policy(str(tmp_path / "out"))
    assert pol.card is not None and pol.card.phase == "sft"
