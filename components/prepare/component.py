"""KFP wrapper for `prepare`: the body only imports the phase and calls `run`."""

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
