"""KFP wrappers for the pipeline's set-up steps: `configure` (validates the run form and the overrides before any
work), `prepare` (the base model) and `skip_phase` (a phase switched off in the run form). Each body only imports
its module and calls it."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Model, Output

from components.core import images


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def prepare(
    preset: str,
    overrides: str,
    base_model_uri: str,
    experiment: str,
    parent_run_id: str,
    corpus: Input[Dataset],
    base_model: Output[Model],
    resolved_config: Output[Artifact],
) -> NamedTuple("PrepareOutputs", [("parent_run_id", str), ("model_uri", str)]):
    """Validate the config and bring in the base model (tiny: built on the sandbox corpus; a path; s3://)."""
    from collections import namedtuple

    from components.prepare import run

    res = run(preset=preset, overrides=overrides, base_model_uri=base_model_uri, experiment=experiment,
              model_out=base_model.path,
              config_out=resolved_config.path, parent_run_id=parent_run_id, corpus=corpus.path)
    base_model.metadata.update({"uri": res.model_uri, **res.metrics})
    return namedtuple("PrepareOutputs", ["parent_run_id", "model_uri"])(res.parent_run_id, res.model_uri)


# the trainer image: the sandbox image holds the environment server only (no KFP executor, no MLflow)
@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def configure(preset: str, overrides: str, form: str, shown: str, pipeline: str, base_model_uri: str,
              experiment: str, kfp_run_id: str = "", kfp_pipeline: str = "",
              ) -> NamedTuple("ConfigureOutputs", [("overrides", str)]):
    """The pipeline's first step: validate the run (preset, run-form parameters, overrides) before any work, and
    hand every phase one overrides object (the changed run-form parameters with `overrides` on top, and the KFP run
    id every MLflow run is tagged with)."""
    import json
    from collections import namedtuple

    from components.core.config import deep_merge
    from components.prepare.form import resolve

    cfg, merged, changed = resolve(preset, overrides, form, shown, pipeline,
                                   {"base_model_uri": base_model_uri, "experiment": experiment})
    if kfp_run_id:
        merged = json.dumps(deep_merge(json.loads(merged), {"tracking": {"kfp_run_id": kfp_run_id,
                                                                         "kfp_pipeline": kfp_pipeline}}),
                            sort_keys=True)
    print(f"configure: valid; preset {cfg.preset}; run-form parameters changed: {', '.join(changed) or 'none'}; "
          f"overrides: {len(overrides)} characters")
    return namedtuple("ConfigureOutputs", ["overrides"])(merged)


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def skip_phase(
    phase: str,
    switch: str,
    preset: str,
    overrides: str,
    parent_run_id: str,
    policy: Input[Model],
    model: Output[Model],
):
    """A phase switched off in the run form: pass the incoming model on; MLflow records the phase as skipped."""
    from components.prepare.skip import run

    res = run(phase, switch, preset=preset, overrides=overrides, policy=policy.path, model_out=model.path,
              parent_run_id=parent_run_id)
    model.metadata.update({**policy.metadata, "skipped": phase, "skip_run_id": res.run_id})


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def finish_run(status: dsl.PipelineTaskFinalStatus, kfp_run_id: str, preset: str, overrides: str, experiment: str,
               parent_run_id: str):
    """The pipeline's exit step (dsl.ExitHandler: it runs whether the pipeline succeeded or failed): end the MLflow
    parent run with the pipeline's state, and send what phases left buffered while MLflow was unreachable."""
    from components.prepare.finish import run

    run(status.state, kfp_run_id, preset, overrides, experiment, parent_run_id, status.error_message or "")
