"""KFP wrapper for `grpo`: the body only imports the phase and calls `run`."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.core import images


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def grpo(
    preset: str,
    overrides: str,
    parent_run_id: str,
    policy: Input[Model],
    world: Input[Dataset],
    tasks: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
) -> NamedTuple("GRPOOutputs", [("model_uri", str)]):
    """Multi-turn GRPO in the sandbox from the SFT model; checkpoints under the parent run, so a retry resumes."""
    from collections import namedtuple

    from components.grpo.recipe import launch

    res = launch(preset=preset, overrides=overrides, policy_model=policy.path, world=world.path, tasks_dir=tasks.path,
                 parent_run_id=parent_run_id, model_out=model.path)
    res.publish(metrics, model, steps=res.steps_done, resumed_from=-1 if res.resumed_from is None else res.resumed_from)
    return namedtuple("GRPOOutputs", ["model_uri"])(res.model_uri)
