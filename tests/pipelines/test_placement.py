"""Placement: the golden h100 pipeline (node pool, GPUs, shm, cache, secrets, retries, timeouts),
deterministic compilation, the committed compiled pipeline kept fresh, and plan overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipelines.cli import main
from pipelines.placement import PHASES, load_plan

COMPILED = Path(__file__).resolve().parents[2] / "pipelines" / "compiled"
TRAINING = ("sft-warmup", "rejection-sampling", "dpo")


def _compile(tmp_path: Path, *extra: str, name: str = "p.yaml") -> str:
    out = tmp_path / name
    assert main(["compile", "-o", str(out), *extra]) == 0
    return out.read_text()


def _normalise(text: str) -> str:  # the SDK version line moves with every KFP release, nothing else may
    return "\n".join(x for x in text.splitlines() if not x.strip().startswith("sdkVersion:"))


def all_tasks(spec: dict) -> dict[str, dict]:
    """Every task of a compiled pipeline, the ones inside condition branches too."""
    dags = [spec["root"]["dag"], *(c["dag"] for c in spec["components"].values() if "dag" in c)]
    return {name: t for d in dags for name, t in d["tasks"].items()}


def test_h100_golden(tmp_path):
    docs = list(yaml.safe_load_all(_compile(tmp_path, "--placement", "h100")))
    spec, platform = docs[0], docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    execs = spec["deploymentSpec"]["executors"]
    tasks = all_tasks(spec)
    for name in TRAINING:
        res = execs[f"exec-{name}"]["container"]["resources"]
        assert res["accelerator"]["resourceCount"] == "8" and res["accelerator"]["resourceType"] == "nvidia.com/gpu"
        assert res["cpuLimit"] == res["cpuRequest"] == 96.0 and res["memoryLimit"] == res["memoryRequest"] == 1610.612736
        k8s = platform[f"exec-{name}"]
        assert k8s["nodeSelector"]["labels"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert k8s["tolerations"] == [{"effect": "NoSchedule", "key": "nvidia.com/gpu", "operator": "Exists"}]
        assert k8s["emptyDirMounts"] == [{"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "256Gi",
                                          "volumeName": "dshm"}]
        assert k8s["pvcMount"][0]["mountPath"] == "/cache" and k8s["pvcMount"][0]["constant"] == "agentrl-model-cache"
        assert k8s["secretAsEnv"][0]["secretName"] == "agentrl-s3"
        assert {e["envVar"] for e in k8s["secretAsEnv"][0]["keyToEnv"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        assert int(k8s["activeDeadlineSeconds"]) == 86400
        assert tasks[name]["retryPolicy"]["maxRetryCount"] == 3
    # CPU-only steps stay off the GPU pool
    assert "accelerator" not in execs["exec-sandbox-build"]["container"].get("resources", {})
    assert "nodeSelector" not in platform["exec-sandbox-build"]
    assert execs["exec-evaluate"]["container"]["resources"]["accelerator"]["resourceCount"] == "1"
    # the phases that generate run in the image with vLLM (the h100 preset samples with it); the others do not
    image = {k.removeprefix("exec-"): v["container"]["image"].rpartition("/")[2] for k, v in execs.items()}
    assert {k for k, v in image.items() if v.startswith("rollout:")} == {"grpo", "rejection-sampling", "dpo", "evaluate"}
    assert image["sft-warmup"].startswith("trainer:") and image["sandbox-build"].startswith("sandbox:")
    # the run form's steps are small CPU pods
    assert image["configure"].startswith("trainer:") and image["skip-phase"].startswith("trainer:")
    assert "accelerator" not in execs["exec-configure"]["container"]["resources"]
    # no secret value is ever inlined: only names of Secrets and keys
    text = yaml.safe_dump(docs)
    assert "secretKey" in text and "aws_secret_access_key=" not in text.lower()


@pytest.mark.parametrize("pipeline", ["agent_rl", "retrain"])
def test_compilation_is_deterministic_and_the_committed_pipelines_are_fresh(tmp_path, pipeline):
    a = _compile(tmp_path, "--pipeline", pipeline, "--placement", "h100", name="a.yaml")
    b = _compile(tmp_path, "--pipeline", pipeline, "--placement", "h100", name="b.yaml")
    assert a == b
    committed = COMPILED / f"{pipeline}.yaml"
    assert committed.exists(), f"{committed} is missing: run `make compile` and commit it"
    assert _normalise(a) == _normalise(committed.read_text()), f"{committed} is stale: run `make compile` and commit it"


def test_local_plan_applies_nothing(tmp_path):
    docs = list(yaml.safe_load_all(_compile(tmp_path, "--placement", "local")))
    assert len(docs) == 1  # no kubernetes platform spec at all
    execs = docs[0]["deploymentSpec"]["executors"]
    assert all("resources" not in e["container"] for e in execs.values())


def test_placement_file_overrides_and_errors(tmp_path):
    f = tmp_path / "pool.yaml"
    f.write_text("defaults:\n  node_selector: {cloud.google.com/gke-accelerator: nvidia-h100-80gb}\n"
                 "phases:\n  sft_warmup: {gpus: 4, retries: 1}\n")
    plan = load_plan("h100", f)
    assert set(plan) == set(PHASES)
    assert plan["sft_warmup"].gpus == 4 and plan["sft_warmup"].retries == 1 and plan["dpo"].gpus == 8
    assert plan["sft_warmup"].node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                                "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    docs = list(yaml.safe_load_all(_compile(tmp_path, "--placement", "h100", "--placement-file", str(f))))
    assert docs[0]["deploymentSpec"]["executors"]["exec-sft-warmup"]["container"]["resources"]["accelerator"][
        "resourceCount"] == "4"
    f.write_text("phases:\n  sft: {gpus: 4}\n")
    with pytest.raises(ValueError, match="unknown phase.*'sft'"):
        load_plan("h100", f)
    f.write_text("phases:\n  sft_warmup: {gpu: 4}\n")
    with pytest.raises(ValueError, match=r"h100/sft_warmup: unknown field\(s\) \['gpu'\]"):
        load_plan("h100", f)
    assert main(["compile", "-o", str(tmp_path / "x.yaml"), "--placement", "h200"]) == 2
