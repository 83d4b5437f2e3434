"""KFP wrapper for `sandbox_build`: the body only imports the phase and calls `run`."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Dataset, Metrics, Output

from components.core import images


@dsl.component(base_image=images.SANDBOX, install_kfp_package=False)
def sandbox_build(
    preset: str,
    overrides: str,
    parent_run_id: str,
    world: Output[Dataset],
    tasks: Output[Dataset],
    demos: Output[Dataset],
    corpus: Output[Dataset],
    metrics: Output[Metrics],
    report: Output[HTML],
) -> NamedTuple("SandboxOutputs", [("parent_run_id", str), ("sandbox_uri", str)]):
    """Generate the workspace world, the task suites and the expert demonstrations; probe the verifiers."""
    import shutil
    from collections import namedtuple
    from pathlib import Path

    from components.sandbox import run

    res = run(preset=preset, overrides=overrides, parent_run_id=parent_run_id, report_path=report.path)
    out = Path(res.out_dir)
    shutil.copyfile(out / "world.json", world.path)
    shutil.copytree(out / "tasks", tasks.path, dirs_exist_ok=True)
    shutil.copytree(out / "demos", demos.path, dirs_exist_ok=True)
    shutil.copyfile(out / "corpus.txt", corpus.path)
    for name, value in sorted(res.metrics.items()):
        metrics.log_metric(name, float(value))
    for art in (world, tasks, demos, corpus):
        art.metadata["uri"] = res.uri
    return namedtuple("SandboxOutputs", ["parent_run_id", "sandbox_uri"])(res.parent_run_id, res.uri)
