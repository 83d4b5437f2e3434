"""Multi-node launch: the TrainJob / PyTorchJob a step creates, its logs streamed while it runs, clear
failures and timeouts — against a local server that records the Kubernetes API calls."""

from __future__ import annotations

import json

import pytest

from components.core.config import MultiNodeConfig
from components.core.launch import JobFailed, JobLauncher, phase_command
from tests.helpers.k8s_api import K8sRecorder


def _launcher(k: K8sRecorder, lines: list[str], **cfg) -> JobLauncher:
    mn = MultiNodeConfig(enabled=True, namespace="team-a", poll_s=0.01, image="reg/trainer:1", **cfg)
    return JobLauncher(mn, api_client=k.api_client(), out=lines.append)


def test_trainjob_is_created_followed_and_awaited():
    logs = ["step 1 loss 2.0", "step 2 loss 1.5", "saved model"]
    with K8sRecorder(["Running", "Running", "Running", "Complete"], logs) as k:
        out: list[str] = []
        launcher = _launcher(k, out, num_nodes=4, gpus_per_node=8)
        cmd = phase_command("components.sft", json.dumps({"preset": "h100"}), "s3://b/r.json", 8)
        launcher.run("agentrl-sft-1", cmd, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"})
    (create,) = [r for r in k.requests if r["method"] == "POST"]
    assert create["path"] == "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs"
    job = create["body"]
    assert job["kind"] == "TrainJob" and job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 4 and trainer["image"] == "reg/trainer:1"
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 8}}
    assert trainer["command"][:2] == ["torchrun", "--nproc-per-node=8"] and "components.sft" in trainer["command"]
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"} in trainer["env"]
    assert out == [f"[agentrl-sft-1-node-0-0] {x}" for x in logs]  # every line once, in order
    pods = [r for r in k.requests if r["path"].endswith("/pods")]
    assert pods[0]["query"]["labelSelector"] == ["jobset.sigs.k8s.io/jobset-name=agentrl-sft-1"]


def test_a_failed_job_raises_with_its_reason():
    with K8sRecorder(["Running", "Failed"], ["starting", "Traceback: CUDA error"]) as k:
        out: list[str] = []
        with pytest.raises(JobFailed, match=r"TrainJob team-a/j failed: BackoffLimitExceeded: node 1 exited"):
            _launcher(k, out).run("j", ["true"], {})
    assert out[-1].endswith("Traceback: CUDA error")


def test_pytorchjob_and_timeout_deletes_the_job():
    with K8sRecorder(["Running"], ["x"]) as k:
        with pytest.raises(JobFailed, match="not done after multi_node.timeout_s=1; deleted"):
            _launcher(k, [], kind="PyTorchJob", num_nodes=3, gpus_per_node=4, timeout_s=1).run("p", ["true"], {})
    (create,) = [r for r in k.requests if r["method"] == "POST"]
    assert create["path"] == "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs"
    specs = create["body"]["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    assert create["body"]["spec"]["nprocPerNode"] == "4"
    assert [r["path"] for r in k.requests if r["method"] == "DELETE"] == [
        "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs/p"]
