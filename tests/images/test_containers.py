"""The CPU images, for real (`make test-images`, part of `make test`): every component of the `agent_rl` pipeline
runs in its own image on the tiny preset, through kfp.local's DockerRunner against podman's Docker API (or a Docker
engine). An image that lacks what its component imports fails its task here.

The images are built first by `images/build.py --variant cpu` (the Makefile target); this module starts
`podman system service` on a socket of its own (with the OCI runtime the build chose) and stops it at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pipelines.test_cli import QUICK

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
TAG = os.environ.get("AGENTRL_IMAGE_TAG", "0.1.0") + "-cpu"
REGISTRY = os.environ.get("AGENTRL_IMAGE_REGISTRY", "ghcr.io/agentrl")


def _build_module():
    spec = importlib.util.spec_from_file_location("agentrl_images_build", ROOT / "images" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def docker_host(tmp_path_factory):
    """DOCKER_HOST of a Docker API: a Docker engine's when one answers, else a podman service started here."""
    build = _build_module()
    eng = build.engine("auto")
    images = [f"{REGISTRY}/{n}:{TAG}" for n in build.NAMES]
    missing = [i for i in images if not build.exists(eng, i)]
    assert not missing, f"build them first (make test-images does): {missing}"
    if eng == "docker":
        yield os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        return
    sock = tmp_path_factory.mktemp("podman") / "podman.sock"
    flags = build.runtime_flags(eng, images[0], "auto")
    proc = subprocess.Popen(["podman", *flags, "system", "service", "--time=0", f"unix://{sock}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.1)
        assert sock.exists(), "podman system service did not open its socket"
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_each_component_runs_in_its_own_image(tmp_path, docker_host):
    home = tmp_path / "home"
    env = {"AGENTRL_HOME": str(home), "HF_HUB_OFFLINE": "1", "PATH": os.environ["PATH"], "HOME": str(tmp_path),
           "DOCKER_HOST": docker_host, "AGENTRL_IMAGE_TAG": TAG, "AGENTRL_IMAGE_REGISTRY": REGISTRY}
    started = time.time()
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", "--runner", "docker", *QUICK],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=1700)
    wall = time.time() - started
    (log,) = (home / "logs").glob("run-*.log")
    text = log.read_text()
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:] + "\n--- log ---\n" + text[-5000:]
    print(f"containerized agent_rl (tiny, quick budgets): {wall:.0f} s\n{res.stdout}")
    for task in ("configure", "sandbox-build", "prepare", "sft-warmup", "grpo", "rejection-sampling", "dpo", "evaluate",
                 "finish-run"):
        assert any(line.split()[:2] == [task, "SUCCESS"] for line in res.stdout.splitlines()), (task, res.stdout)
    # each task ran in the image the compiled pipeline names for it (kfp.local's DockerRunner says which it found)
    where, task = {}, None
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():  # kfp.local colours task names
        if m := re.search(r"Executing task '([^']+)'", line):
            task = m.group(1)
        elif (m := re.search(r"Found image '([^']+)'", line)) and task:
            where[task] = m.group(1).rsplit("/", 1)[-1].split(":")[0]
    assert where.get("sandbox-build") == "sandbox", where
    assert where.get("prepare") == where.get("sft-warmup") == where.get("configure") == "trainer", where
    assert where.get("grpo") == where.get("rejection-sampling") == where.get("dpo") == where.get("evaluate") \
        == "rollout", where
    report = json.loads((home / "last_run.json").read_text())
    assert report["status"] == "FINISHED"
    assert {"sft", "grpo", "rejection_sampling", "dpo", "eval"} <= set(report["phases"])
    assert all(p["status"] == "FINISHED" for p in report["phases"].values()), report["phases"]
    assert "hard/tgc" in report["metrics"]["eval"]


def test_an_image_without_an_import_fails_its_task(docker_host):
    """The check above can fail: the GRPO loss imports torch, which the trainer image has and the sandbox image not."""
    import docker

    code = ["python3", "-c", "from components.grpo.loss import grpo_loss; print('ok')"]
    client = docker.DockerClient(base_url=docker_host)
    try:
        assert client.containers.run(f"{REGISTRY}/trainer:{TAG}", code, network_mode="host", remove=True) == b"ok\n"
        with pytest.raises(docker.errors.ContainerError) as err:
            client.containers.run(f"{REGISTRY}/sandbox:{TAG}", code, network_mode="host", remove=True, stderr=True)
        assert b"No module named 'torch'" in (err.value.stderr or b""), err.value.stderr
    finally:
        client.close()
