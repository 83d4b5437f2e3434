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
    # each phase asks for the GPUs it uses: SFT runs torchrun over the pod's 8; GRPO with vLLM (the h100 preset)
    # is one process on tensor_parallel_size=1 GPU; rejection sampling and DPO are one process each
    gpus = {name: execs[f"exec-{name}"]["container"]["resources"]["accelerator"]["resourceCount"]
            for name in ("sft-warmup", "grpo", "rejection-sampling", "dpo", "evaluate")}
    assert gpus == {"sft-warmup": "8", "grpo": "1", "rejection-sampling": "1", "dpo": "1", "evaluate": "1"}
    for name in TRAINING:
        res = execs[f"exec-{name}"]["container"]["resources"]
        assert res["accelerator"]["resourceType"] == "nvidia.com/gpu"
        if name == "sft-warmup":
            assert res["cpuLimit"] == res["cpuRequest"] == 96.0
            assert res["memoryLimit"] == res["memoryRequest"] == 1610.612736
        k8s = platform[f"exec-{name}"]
        assert k8s["nodeSelector"]["labels"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert k8s["tolerations"] == [{"effect": "NoSchedule", "key": "nvidia.com/gpu", "operator": "Exists"}]
        assert k8s["emptyDirMounts"] == [{"medium": "Memory", "mountPath": "/dev/shm",
                                          "sizeLimit": "256Gi" if name == "sft-warmup" else "32Gi", "volumeName": "dshm"}]
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
    # every pod reads where MLflow and the store are from the chart's ConfigMap (helm: templates/platform.yaml)
    for name in execs:
        cm = platform[name]["configMapAsEnv"]
        assert [c["configMapName"] for c in cm] == ["agentrl-platform"] and cm[0]["optional"] is True, name
        assert {e["envVar"] for e in cm[0]["keyToEnv"]} == {"MLFLOW_TRACKING_URI", "AGENTRL_STORAGE_ROOT",
                                                             "AWS_ENDPOINT_URL"}
    # no secret value is ever inlined: only names of Secrets and keys
    text = yaml.safe_dump(docs)
    assert "secretKey" in text and "aws_secret_access_key=" not in text.lower()


def test_caching_by_intent(tmp_path, capsys):
    """Only `configure` (a pure function of the run form) may come from KFP's cache in agent_rl; nothing in the
    retrain pipeline does (a weekly retrain with the same parameters must retrain)."""
    from pipelines.cli import cache_summary

    for pipeline, placement in [("agent_rl", "h100"), ("agent_rl", "local"), ("retrain", "h100")]:
        out = tmp_path / f"{pipeline}-{placement}.yaml"
        assert main(["compile", "--pipeline", pipeline, "--placement", placement, "-o", str(out)]) == 0
        spec = next(d for d in yaml.safe_load_all(out.read_text()) if d and "root" in d)
        cached = {n for n, t in all_tasks(spec).items() if t.get("cachingOptions", {}).get("enableCache")}
        assert cached == ({"configure"} if pipeline == "agent_rl" else set()), (pipeline, placement)
        summary = cache_summary(out)
        assert summary["cached"] == sorted(cached) and "evaluate" in summary["always_run"]
        assert f"KFP cache: may serve {'configure' if cached else 'nothing'}; always run:" in capsys.readouterr().out
    for committed in ("agent_rl", "retrain"):
        assert cache_summary(COMPILED / f"{committed}.yaml")["cached"] == (["configure"] if committed == "agent_rl"
                                                                            else [])


def test_gpus_follow_the_compile_preset(tmp_path):
    """GRPO's GPU request follows the preset it is compiled with: vLLM (h100) one process on tensor_parallel_size
    GPUs; the hf backend (small) torchrun over all of them."""
    def grpo_gpus(*extra: str) -> str:
        spec = yaml.safe_load_all(_compile(tmp_path, "--placement", "h100", *extra, name="g.yaml"))
        return next(spec)["deploymentSpec"]["executors"]["exec-grpo"]["container"]["resources"]["accelerator"][
            "resourceCount"]

    assert grpo_gpus("--preset", "h100") == "1"
    assert grpo_gpus("--preset", "small") == "8"


def test_run_device_auto_resolves_to_what_torch_sees():
    import torch

    from components.core.config import RunConfig

    has = torch.cuda.is_available()
    assert RunConfig(device="auto").torch_device() == ("cuda" if has else "cpu")
    assert RunConfig(device="cpu").torch_device() == "cpu"
    if not has:
        with pytest.raises(ValueError, match="run.device='cuda'.*no CUDA device"):
            RunConfig(device="cuda").torch_device()


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
    # but kfp.local honours retries: every phase but configure (the run form's errors) is started once more
    retried = {n: t.get("retryPolicy") for n, t in all_tasks(docs[0]).items()}
    assert retried["configure"] is None
    assert all(p == {"backoffDuration": "1s", "backoffFactor": 2.0, "backoffMaxDuration": "3600s", "maxRetryCount": 1}
               for n, p in retried.items() if n != "configure" and not n.startswith(("condition", "exit-handler"))), retried


def test_containers_run_each_phase_in_the_image_the_cluster_gives_it():
    from pipelines.placement import GENERATING, PLANS

    cluster, local = PLANS["h100"], PLANS["containers"]
    in_rollout = {ph for ph, spec in cluster.items() if isinstance(spec, dict) and spec.get("image") == "rollout"}
    assert in_rollout == set(GENERATING) == {ph for ph, spec in local.items() if spec.get("image") == "rollout"}


def test_placement_file_overrides_and_errors(tmp_path):
    f = tmp_path / "pool.yaml"
    f.write_text("defaults:\n  node_selector: {cloud.google.com/gke-accelerator: nvidia-h100-80gb}\n"
                 "phases:\n  sft_warmup: {gpus: 4, retries: 1}\n")
    plan = load_plan("h100", f)
    assert set(plan) == set(PHASES)
    assert plan["sft_warmup"].gpus == 4 and plan["sft_warmup"].retries == 1 and plan["dpo"].gpus == 1
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
