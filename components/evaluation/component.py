"""KFP wrappers for `evaluate` and `promote`: the bodies only import the phase and call it."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from components.core import images


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def evaluate(
    preset: str,
    overrides: str,
    parent_run_id: str,
    model: Input[Model],
    world: Input[Dataset],
    tasks: Input[Dataset],
    metrics: Output[Metrics],
    report: Output[HTML],
) -> NamedTuple("EvalOutputs", [("promote", bool), ("version", str)]):
    """Held-out suites (easy, hard, safety, robustness) against the champion; register as challenger."""
    from collections import namedtuple

    from components.evaluation.recipe import run

    res = run(preset=preset, overrides=overrides, model=model.path, world=world.path, tasks_dir=tasks.path,
              parent_run_id=parent_run_id, promote=False, report_out=report.path)
    for name, value in sorted(res.flat.items()):
        metrics.log_metric(name.replace("/", "_"), float(value))
    return namedtuple("EvalOutputs", ["promote", "version"])(res.decision.promote, res.version or "")


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def promote(version: str, overrides: str):
    """Move the registry's `champion` alias to this model version (runs only when the gate said so)."""
    from components.core.config import load_config
    from components.core.tracking import resolve_tracking_uri
    from components.evaluation.recipe import promote_version

    cfg = load_config(overrides_json=overrides or None)
    promote_version(version, resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.run.home), cfg.tracking.registered_model)


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def champion(overrides: str, model: Output[Model]) -> str:
    """The model registry's current `champion`, downloaded: where scheduled retraining starts."""
    from components.evaluation.recipe import fetch_champion

    version = fetch_champion(overrides, model.path)
    model.metadata.update({"version": version})
    return version
