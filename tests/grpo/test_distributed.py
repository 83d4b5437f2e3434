"""GRPO over several processes: data parallel under torchrun (gloo on CPU, the path of a multi-GPU pod),
resumed from its checkpoint on a retry, and launched as a multi-node job (the recording Kubernetes API
server runs it for real)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from components.core.checkpoint import Checkpoints
from components.core.config import load_config
from components.core.policy import load_policy
from components.core.tracking import local_tracking_uri, start_pipeline_run
from components.grpo import recipe

pytestmark = pytest.mark.slow


def _overrides(home: Path, **extra) -> dict:
    return {"run": {"home": str(home), "torch_threads": 1},
            "sandbox": {"max_turns": 2, "suite_sizes": {"easy": 2}},
            "generation": {"max_new_tokens": 16},
            "grpo": {"steps": 3, "tasks_per_step": 2, "group_size": 2, "micro_batch_size": 2, "eval_every": 0,
                     "eval_suites": ["easy"], "checkpoint_every": 1, "learning_rate": 1e-3, "torch_threads": 1,
                     "output": "last", "group_filter": "none", **extra}}  # every sample fails: keep a gradient


def test_two_processes_roll_out_their_share_and_resume_on_a_retry(tmp_path, tiny_model_dir, monkeypatch):
    home = tmp_path / "home"
    parent = start_pipeline_run(local_tracking_uri(home), "agentrl", "grpo-ddp")
    kwargs = {"overrides": json.dumps(_overrides(home)), "policy_model": str(tiny_model_dir),
              "parent_run_id": parent, "model_out": str(tmp_path / "out")}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    res = recipe.launch(processes=2, **kwargs)
    assert res.steps_done == 3 and res.metrics["world_size"] == 2.0
    assert res.metrics["trained_tokens"] > 0 and "heldout/easy/tgc" in res.metrics
    assert load_policy(str(tmp_path / "out")).card.phase == "grpo"

    # rank 0 tracked, once; each of the two ranks rolled out one group of 2 per step: 4 episodes a step
    client = MlflowClient(local_tracking_uri(home))
    runs = client.search_runs(client.get_experiment_by_name("agentrl").experiment_id, "tags.`agentrl.phase` = 'grpo'")
    assert len(runs) == 1
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "grpo/success_rate")] == [1, 2, 3]
    ckpts = Checkpoints(str(home / "store" / "checkpoints" / parent / "grpo"), staging=tmp_path / "probe")
    step, uri = ckpts.latest()
    assert step == 3 and (Path(uri) / "accelerate").is_dir()

    # a KFP retry of the finished step resumes from its last checkpoint: nothing to redo, the same run
    again = recipe.launch(processes=2, **kwargs)
    assert again.resumed_from == 3 and again.steps_done == 3 and again.run_id == res.run_id


def test_tasks_per_step_must_split_evenly_over_the_processes(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ov = _overrides(tmp_path / "home", tasks_per_step=3)
    with pytest.raises(ValueError, match=r"grpo.tasks_per_step=3 must be a multiple of the number of processes \(2\)"):
        recipe.run(overrides=json.dumps(ov), policy_model=str(tiny_model_dir))
    ov = _overrides(tmp_path / "home", multi_node={"enabled": True})
    ov["generation"]["backend"] = "vllm"
    with pytest.raises(ValueError, match="grpo.multi_node.enabled with generation.backend='vllm'"):
        load_config(overrides_json=json.dumps(ov))


def test_grpo_as_a_multi_node_job_with_inputs_staged_on_s3(tmp_path, tiny_model_dir, monkeypatch, bucket, s3_endpoint):
    from tests.helpers.k8s_api import K8sRecorder

    home = tmp_path / "home"
    ov = _overrides(home, steps=2, multi_node={"enabled": True, "num_nodes": 1, "gpus_per_node": 0, "namespace": "ml",
                                               "poll_s": 0.2})
    ov["storage"] = {"root": f"s3://{bucket}/runs"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", local_tracking_uri(home))
    job_env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                            "AWS_DEFAULT_REGION", "HF_HUB_OFFLINE")}
    job_env.update(PYTHONPATH=os.getcwd(), AGENTRL_HOME=str(tmp_path / "job-home"), OMP_NUM_THREADS="1")
    with K8sRecorder(execute_env=job_env) as k:
        from components.core import launch

        real = launch.JobLauncher
        monkeypatch.setattr(launch, "JobLauncher", lambda cfg, api_client=None, out=print:
                            real(cfg, api_client=k.api_client(), out=out))
        res = recipe.launch(overrides=json.dumps(ov), policy_model=str(tiny_model_dir),
                                     model_out=str(tmp_path / "out"))
    (create,) = [r for r in k.requests if r["method"] == "POST"]
    command = create["body"]["spec"]["trainer"]["command"]
    assert command[:2] == ["torchrun", "--nproc-per-node=1"] and "components.grpo" in command
    remote = json.loads(command[command.index("--args") + 1])
    assert remote["policy_model"].startswith(f"s3://{bucket}/runs/multi-node/agentrl-grpo-")
    assert res.steps_done == 2 and res.model_uri.startswith(f"s3://{bucket}/")
    assert load_policy(str(tmp_path / "out")).card.phase == "grpo"


def test_the_best_models_weights_load_back_into_zero3_shards(tmp_path, tiny_model_dir):
    """`grpo.output=best` under DeepSpeed ZeRO-3: the best step's tensors are gathered from the shards to be saved,
    and loaded back into the shards (gathered, copied, partitioned again) before the held-out numbers and the save."""
    import subprocess
    import sys

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          str(Path(__file__).parent / "zero3_best_weights.py"), str(tiny_model_dir), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"restored [1-9][0-9]* tensors on 2 processes", out.stdout), out.stdout[-2000:]
