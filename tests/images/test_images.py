"""Static checks of the Dockerfiles and of what each image installs (tests/images/test_containers.py builds and
runs them): pinned bases and packages, a non-root user, the project installed; one requirements file per image,
read by its Dockerfile and here; the sandbox image's server needs no ML stack."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata as md
from pathlib import Path

import pytest

from components.core import images

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("trainer", "rollout", "sandbox")


def requirements(name: str) -> set[str]:
    lines = (ROOT / "images" / name / "requirements.txt").read_text().splitlines()
    return {x.strip().lower() for x in lines if x.strip() and not x.startswith("#")}


def constraints() -> dict[str, str]:
    lines = [x for x in (ROOT / "images" / "constraints.txt").read_text().splitlines() if x and not x.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+-]*", x) for x in lines), lines
    return {x.split("==")[0].lower(): x.split("==")[1] for x in lines}


def project_dependencies() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~ \[]", d)[0].lower() for d in deps}


@pytest.mark.parametrize("name", NAMES)
def test_dockerfile_is_pinned_non_root_and_installs_its_requirements(name):
    text = (ROOT / "images" / name / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE}"]  # the CPU variant swaps the base (images/build.py)
    (base,) = re.findall(r"^ARG BASE=(\S+)", text, re.M)
    assert ":" in base and not base.endswith(":latest") and re.search(r":v?\d+\.\d+", base), base
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0") and users[-1].split(":")[0].isdigit()
    assert "COPY components /src/components" in text and "COPY pipelines /src/pipelines" in text
    assert f"COPY images/{name}/requirements.txt /tmp/requirements.txt" in text
    assert re.search(r"pip install -c /tmp/constraints(-rollout)?\.txt -r /tmp/requirements\.txt", text)
    assert "pip install --no-cache-dir --no-deps /src" in text  # the project without re-resolving the above
    assert not re.search(r'^ENTRYPOINT \[\s*"', text, re.M)  # KFP and `docker run IMAGE cmd` give the whole command
    assert getattr(images, name.upper()).endswith(f"/{name}:{images.TAG}")


@pytest.mark.parametrize("name", NAMES)
def test_every_requirement_is_pinned(name):
    pins = constraints()
    assert requirements(name) and requirements(name) <= set(pins), sorted(requirements(name) - set(pins))


def test_the_tests_run_at_the_images_versions():
    """`make setup` installs with images/constraints.txt: the tests write tracking stores the images then read."""
    installed = {name: md.version(name) for name in constraints()}
    assert installed == constraints(), {n: (v, constraints()[n]) for n, v in installed.items() if v != constraints()[n]}
    assert "-c images/constraints.txt" in (ROOT / "Makefile").read_text()


def test_training_images_hold_every_project_dependency():
    deps = project_dependencies()
    assert deps - {"torch"} <= requirements("trainer"), sorted(deps - {"torch"} - requirements("trainer"))
    vllm_brings = {"torch", "transformers", "tokenizers"}
    assert deps - vllm_brings <= requirements("rollout"), sorted(deps - vllm_brings - requirements("rollout"))
    assert not vllm_brings & requirements("rollout")
    assert "deepspeed" in requirements("trainer") & requirements("rollout")  # ZeRO (the h100 preset) in both


def test_torch_pin_matches_the_tests():
    trainer = (ROOT / "images" / "trainer" / "Dockerfile").read_text()
    pinned_torch = re.search(r"ARG TORCH_VERSION=(\S+)", trainer).group(1)
    assert f"torch=={pinned_torch}" in (ROOT / "Makefile").read_text()  # the images train with the tests' torch
    assert f"ARG TORCH_VERSION={pinned_torch}" in (ROOT / "images" / "rollout" / "Dockerfile").read_text()


def test_sandbox_requirements_cover_what_its_component_imports():
    """The sandbox_build component's modules import these (the rest of its imports are lazy: the container test)."""
    code = ("import sys, importlib.metadata as md; import components.sandbox.component, components.sandbox.recipe, "
            "components.core.tracking, components.core.storage, components.core.reporting; "
            "d = md.packages_distributions(); d['kfp'] = ['kfp']; "  # kfp is a namespace several packages share
            "print(' '.join(sorted({x.lower() for m in list(sys.modules) for x in d.get(m.split('.')[0], [])})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    imported = set(out.stdout.split()) & (project_dependencies() | {"kfp"})
    installed = set(requirements("sandbox"))  # with what the listed packages require themselves
    for name in sorted(requirements("sandbox")):
        installed |= {re.split(r"[<>=!~ \[;(]", r)[0].lower() for r in (md.requires(name) or []) if "extra ==" not in r}
    assert imported and imported <= installed, sorted(imported - installed)


def test_sandbox_server_imports_no_ml_stack():
    code = ("import sys; import pipelines.cli, components.sandbox.server, components.sandbox.world; "
            "from components.core.config import load_config; from components.core.env import load; "
            "load(load_config(set_pairs=['env.name=helpdesk'])); "  # `agentrl env serve --env helpdesk` loads it
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'trl', 'peft', "
            "'mlflow', 'boto3', 'datasets', 'accelerate'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout
