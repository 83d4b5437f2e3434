"""Static checks of the Dockerfiles (no Docker engine here; `make images` builds them where one exists):
pinned bases and packages, a non-root user, the project installed; the sandbox image's server needs no ML stack."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from components.core import images

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("trainer", "rollout", "sandbox")


@pytest.mark.parametrize("name", NAMES)
def test_dockerfile_is_pinned_non_root_and_installs_the_project(name):
    text = (ROOT / "images" / name / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert ":" in base and not base.endswith(":latest") and re.search(r":v?\d+\.\d+", base), base
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0") and users[-1].split(":")[0].isdigit()
    assert "COPY components /src/components" in text and "COPY pipelines /src/pipelines" in text
    assert re.search(r"-c /tmp/constraints(-rollout)?\.txt", text)
    assert getattr(images, name.upper()).endswith(f"/{name}:{images.TAG}")


def test_constraints_pin_every_package_and_match_torch():
    lines = [x for x in (ROOT / "images" / "constraints.txt").read_text().splitlines() if x and not x.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+-]*", x) for x in lines)
    trainer = (ROOT / "images" / "trainer" / "Dockerfile").read_text()
    pinned_torch = re.search(r"ARG TORCH_VERSION=(\S+)", trainer).group(1)
    makefile = (ROOT / "Makefile").read_text()
    assert f"torch=={pinned_torch}" in makefile  # the images train with the torch the tests ran with


def test_rollout_image_installs_every_dependency_but_the_ones_vllm_brings():
    import tomllib

    text = (ROOT / "images" / "rollout" / "Dockerfile").read_text()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ]", d)[0].lower() for d in deps}
    vllm_brings = {"torch", "transformers", "tokenizers"}
    block = text[text.index("pip install -c /tmp/constraints-rollout.txt"):]
    listed = set(re.findall(r"[a-z][a-z0-9-]*", block.split("\n\n")[0].replace("\\\n", " "))) - {"pip", "install", "c",
                                                                                                 "tmp", "txt"}
    assert names - vllm_brings <= listed, sorted(names - vllm_brings - listed)
    assert "deepspeed" in listed  # GRPO and DPO train here too (the h100 preset's ZeRO)


def test_sandbox_server_imports_no_ml_stack():
    code = ("import sys; import pipelines.cli, components.sandbox.server, components.sandbox.world; "
            "from components.core.config import load_config; from components.core.env import load; "
            "load(load_config(set_pairs=['env.name=helpdesk'])); "  # `agentrl env serve --env helpdesk` loads it

            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'trl', 'peft', "
            "'mlflow', 'boto3', 'datasets', 'accelerate'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout
