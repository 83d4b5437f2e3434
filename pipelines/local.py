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


def init(pipeline_root: str | Path) -> None:
    """`kfp.local.init` with the subprocess runner in this environment, and artifact `dsl.OneOf` resolved."""
    from kfp import local
    from kfp.local.orchestrator.orchestrator_utils import OrchestratorUtils

    OrchestratorUtils.get_dag_output_artifacts = classmethod(_one_of_artifacts)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root))
