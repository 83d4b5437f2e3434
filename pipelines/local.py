"""kfp.local, set up for agentrl's pipelines (the embedded default: `agentrl run`, `make run`).

kfp.local (2.17) resolves `dsl.OneOf` over parameters but not over artifacts: a DAG output that selects one of
two branches' models raises "Expected 1 artifact in ArtifactSelectorSpec. Got: 2". The cluster's backend
resolves both; `_one_of_artifacts` gives kfp.local the same rule it already has for parameters (the one branch
that produced the output), so the pipeline that runs here is the one the cluster runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _one_of_artifacts(cls, dag_outputs_spec, io_store) -> dict[str, Any]:
    outputs: dict[str, Any] = {}
    for key, spec in dag_outputs_spec.artifacts.items():
        found = []
        for selector in spec.artifact_selectors:
            try:
                found.append(io_store.get_task_output(selector.producer_subtask, selector.output_artifact_key))
            except (KeyError, ValueError):  # that branch did not run
                continue
        if len(found) != 1:
            raise ValueError(f"dsl.OneOf output {key!r}: {len(found)} of the branches produced it, expected exactly 1")
        outputs[key] = found[0]
    return outputs


# what a task's container gets from this process's environment, when set (the platform's URIs and S3 credentials)
PASSED_ENV = ("MLFLOW_TRACKING_URI", "AGENTRL_STORAGE_ROOT", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
              "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "MLFLOW_S3_ENDPOINT_URL", "HF_HUB_OFFLINE",
              "TOKENIZERS_PARALLELISM")


def _run_container(client, image: str, command: list[str], volumes: dict[str, Any], **run_args) -> int:
    """kfp.local's `run_docker_container` without auto-remove: podman's Docker API answers a removed container's
    log request with 500, not 404, so a task that exits before its logs are read failed there. The container is
    removed after its exit code is read."""
    from kfp.local.docker_task_handler import add_latest_tag_if_not_present

    image = add_latest_tag_if_not_present(image)
    if not any(image in (i.tags + i.attrs.get("RepoDigests", [])) for i in client.images.list()):
        print(f"Pulling image {image!r}")
        client.images.pull(image)
    print(f"Found image {image!r}\n")
    container = client.containers.run(image=image, command=command, detach=True, stdout=True, stderr=True,
                                      volumes=volumes, **run_args)
    try:
        for line in container.logs(stream=True, follow=True):
            print(line.decode(errors="replace"), end="")
        return int(container.wait()["StatusCode"])
    finally:
        container.remove(force=True)


def init(pipeline_root: str | Path, runner: str = "subprocess") -> None:
    """`kfp.local.init` with artifact `dsl.OneOf` resolved, and the runner:

    - `subprocess`: every task in this environment (the embedded default);
    - `docker`: every task in its own image (kfp.local's DockerRunner; with podman, its Docker API socket at
      DOCKER_HOST). The pipeline root is the only folder mounted (at the same path), so it must hold AGENTRL_HOME:
      the container runs as this user, on the host's network (a loopback MLflow or S3 is reachable), with HOME
      under the root and the variables of PASSED_ENV that are set here.
    """
    import os

    from kfp import local
    from kfp.local.orchestrator.orchestrator_utils import OrchestratorUtils

    OrchestratorUtils.get_dag_output_artifacts = classmethod(_one_of_artifacts)
    if runner == "subprocess":
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root))
    elif runner == "docker":
        from kfp.local import docker_task_handler

        docker_task_handler.run_docker_container = _run_container
        root = Path(pipeline_root).resolve()
        home = root / "container_home"
        home.mkdir(parents=True, exist_ok=True)
        env = {k: os.environ[k] for k in PASSED_ENV if os.environ.get(k)}
        env.update(HOME=str(home), AGENTRL_HOME=os.environ.get("AGENTRL_HOME", str(root)), PYTHONUNBUFFERED="1",
                   PYTHONFAULTHANDLER="1")
        local.init(runner=local.DockerRunner(network_mode="host", user=f"{os.getuid()}:{os.getgid()}", environment=env),
                   pipeline_root=str(root))
    else:
        raise ValueError(f"runner {runner!r}: expected 'subprocess' or 'docker'")
