"""Multi-node training from inside a pipeline step: launch a Kubeflow Trainer TrainJob (or a Kubeflow
PyTorchJob) that runs a phase's module with the step's own image, stream its logs, wait, fail clearly.

The step's pod needs the namespaced Role of helm/agentrl (create/get/watch/delete trainjobs or
pytorchjobs, read pods and their logs). Each node runs `torchrun` over its GPUs (the runtime or the
PyTorchJob sets the rendezvous); the phase's rank 0 tracks and writes results to storage, where the
launching step reads them back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.core.config import MultiNodeConfig

TRAINJOB = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
PYTORCHJOB = ("kubeflow.org", "v1", "pytorchjobs")
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class JobFailed(RuntimeError):
    pass


def current_namespace(default: str = "default") -> str:
    return SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.exists() else os.environ.get("POD_NAMESPACE", default)


def _env(env: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in sorted(env.items())]


def trainjob_manifest(name: str, image: str, command: list[str], cfg: MultiNodeConfig, env: dict[str, str],
                      labels: dict[str, str] | None = None) -> dict[str, Any]:
    resources = {"limits": {cfg.gpu_resource: cfg.gpus_per_node}} if cfg.gpus_per_node else {}
    return {
        "apiVersion": f"{TRAINJOB[0]}/{TRAINJOB[1]}", "kind": "TrainJob",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {
            "runtimeRef": {"name": cfg.runtime, "apiGroup": TRAINJOB[0], "kind": "ClusterTrainingRuntime"},
            "trainer": {"image": image, "command": command, "numNodes": cfg.num_nodes,
                        "resourcesPerNode": resources, "env": _env(env)},
        },
    }


def pytorchjob_manifest(name: str, image: str, command: list[str], cfg: MultiNodeConfig, env: dict[str, str],
                        labels: dict[str, str] | None = None) -> dict[str, Any]:
    resources = {"limits": {cfg.gpu_resource: cfg.gpus_per_node}} if cfg.gpus_per_node else {}

    def replica(n: int) -> dict[str, Any]:
        return {"replicas": n, "restartPolicy": "OnFailure", "template": {"spec": {"containers": [
            {"name": "pytorch", "image": image, "command": command, "env": _env(env), "resources": resources}]}}}

    specs = {"Master": replica(1)}
    if cfg.num_nodes > 1:
        specs["Worker"] = replica(cfg.num_nodes - 1)
    return {"apiVersion": f"{PYTORCHJOB[0]}/{PYTORCHJOB[1]}", "kind": "PyTorchJob",
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"nprocPerNode": str(cfg.gpus_per_node or 1), "pytorchReplicaSpecs": specs}}


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}


class JobLauncher:
    """Create one job, follow the logs of its first pod, return when it succeeds, raise JobFailed otherwise."""

    def __init__(self, cfg: MultiNodeConfig, api_client: Any = None, out: Callable[[str], None] = print) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.cfg = cfg
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = cfg.namespace or current_namespace()
        self.group, self.version, self.plural = TRAINJOB if cfg.kind == "TrainJob" else PYTORCHJOB
        self.out = out
        self._printed: dict[str, int] = {}

    def manifest(self, name: str, command: list[str], env: dict[str, str], image: str | None = None) -> dict[str, Any]:
        from components.core import images

        image = image or self.cfg.image or os.environ.get("AGENTRL_IMAGE") or images.TRAINER
        build = trainjob_manifest if self.cfg.kind == "TrainJob" else pytorchjob_manifest
        return build(name, image, command, self.cfg, env, {"app.kubernetes.io/part-of": "agentrl"})

    def submit(self, manifest: dict[str, Any]) -> str:
        self.custom.create_namespaced_custom_object(self.group, self.version, self.namespace, self.plural, manifest)
        return manifest["metadata"]["name"]

    def _selector(self, name: str) -> str:
        if self.cfg.kind == "TrainJob":
            return f"jobset.sigs.k8s.io/jobset-name={name}"
        return f"training.kubeflow.org/job-name={name},training.kubeflow.org/replica-type=master"

    def _stream_logs(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=self._selector(name)).items
        except ApiException:
            return
        for pod in sorted(pods, key=lambda p: p.metadata.name)[:1]:  # the first node: rank 0 logs the phase
            try:
                text = self.core.read_namespaced_pod_log(pod.metadata.name, self.namespace)
            except ApiException:
                continue
            seen = self._printed.get(pod.metadata.name, 0)
            if len(text) > seen:
                for line in text[seen:].splitlines():
                    self.out(f"[{pod.metadata.name}] {line}")
                self._printed[pod.metadata.name] = len(text)

    def wait(self, name: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            obj = self.custom.get_namespaced_custom_object(self.group, self.version, self.namespace, self.plural, name)
            self._stream_logs(name)
            cond = _conditions(obj)
            if "Failed" in cond:
                c = cond["Failed"]
                raise JobFailed(f"{self.cfg.kind} {self.namespace}/{name} failed: {c.get('reason', '')}: "
                                f"{c.get('message', '')}".rstrip(": "))
            if "Complete" in cond or "Succeeded" in cond:
                return obj
            if time.monotonic() > deadline:
                self.delete(name)
                raise JobFailed(f"{self.cfg.kind} {self.namespace}/{name}: not done after "
                                f"multi_node.timeout_s={self.cfg.timeout_s}; deleted")
            time.sleep(self.cfg.poll_s)

    def delete(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.custom.delete_namespaced_custom_object(self.group, self.version, self.namespace, self.plural, name)
        except ApiException:
            pass

    def run(self, name: str, command: list[str], env: dict[str, str]) -> dict[str, Any]:
        self.submit(self.manifest(name, command, env))
        return self.wait(name)


def phase_command(module: str, kwargs_json: str, result_uri: str, gpus_per_node: int) -> list[str]:
    """torchrun over a node's GPUs; the rendezvous comes from the TrainJob runtime / PyTorchJob env."""
    return ["torchrun", f"--nproc-per-node={max(1, gpus_per_node)}", "-m", module, "--args", kwargs_json,
            "--result", result_uri]


# ----------------------------------------------------------------------------------------------
# A phase over several processes: torchrun on this pod, or a job over several nodes
# ----------------------------------------------------------------------------------------------
JOB_ENV = ("MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "MLFLOW_S3_ENDPOINT_URL", "HF_HUB_OFFLINE")


def run_torchrun(module: str, nproc: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run `python -m <module> --args ...` under torchrun with `nproc` processes (one per GPU; gloo on CPU
    in tests) and return rank 0's result. The processes share one work directory (`work_dir`)."""
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "result.json"
        kwargs = {**kwargs, "work_dir": kwargs.get("work_dir") or str(Path(d) / "work")}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
               "-m", module, "--args", json.dumps(kwargs), "--result", str(result)]
        subprocess.run(cmd, check=True)
        return json.loads(result.read_text())


def run_as_job(module: str, phase: str, mn: MultiNodeConfig, storage_root: str | None, kwargs: dict[str, Any],
               dir_keys: tuple[str, ...], file_keys: dict[str, str]) -> dict[str, Any]:
    """Run a phase as a multi-node TrainJob/PyTorchJob and wait for it; return its rank 0's result.

    The step's local inputs are staged to storage first (the job's pods cannot see this pod's files):
    `dir_keys` name directory arguments, `file_keys` file arguments (with the name they get on storage).
    The job's rank 0 tracks under the same parent run, stores the model and writes the result back.
    """
    import json
    import uuid

    from components.core import storage

    if not storage_root or not storage.is_s3(storage_root):
        raise ValueError(f"{phase}.multi_node.enabled needs storage.root on S3 (the job's pods share nothing else)")
    job = f"agentrl-{phase.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
    staged = storage.join(storage_root, "multi-node", job)
    remote = dict(kwargs)
    for key in dir_keys:
        if kwargs.get(key) and not storage.is_s3(kwargs[key]):
            storage.put_dir(kwargs[key], storage.join(staged, key))
            remote[key] = storage.join(staged, key)
    for key, name in file_keys.items():
        if kwargs.get(key) and not storage.is_s3(kwargs[key]):
            storage.put_file(kwargs[key], storage.join(staged, name))
            remote[key] = storage.join(staged, name)
    remote["model_out"] = None  # each job writes its own directory and stores it under the run's prefix
    result_uri = storage.join(staged, "result.json")
    env = {k: v for k, v in os.environ.items() if k in JOB_ENV}
    JobLauncher(mn).run(job, phase_command(module, json.dumps(remote), result_uri, mn.gpus_per_node), env)
    res = json.loads(storage.read_text(result_uri))
    if kwargs.get("model_out"):
        storage.get_dir(res["model_uri"], kwargs["model_out"])
        res["model_dir"] = kwargs["model_out"]
    return res
