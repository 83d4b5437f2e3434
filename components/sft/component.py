"""KFP wrapper for `sft_warmup`: the body only imports the phase and calls `run`."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.core import images


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def sft_warmup(
    preset: str,
    overrides: str,
    parent_run_id: str,
    base_model: Input[Model],
    demos: Input[Dataset],
    world: Input[Dataset],
    tasks: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
) -> NamedTuple("SFTOutputs", [("model_uri", str)]):
    """Fine-tune the base model on the expert demonstrations (loss on the agent's own tokens only)."""
    from collections import namedtuple

    from components.sft.recipe import launch

    # base_model_ref: where the base is stored (S3), named in a LoRA adapter's card for the pods of later phases
    res = launch(preset=preset, overrides=overrides, base_model=base_model.path,
                 base_model_ref=base_model.metadata.get("uri", ""), demos=demos.path, world=world.path,
                 tasks_dir=tasks.path, parent_run_id=parent_run_id, model_out=model.path)
    res.publish(metrics, model, **{k: float(v) for k, v in res.metrics.items()})
    return namedtuple("SFTOutputs", ["model_uri"])(res.model_uri)
