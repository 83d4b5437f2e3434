"""KFP wrapper for `rejection_sampling`: the body only imports the phase and calls `run`."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.core import images


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def rejection_sampling(
    preset: str,
    overrides: str,
    parent_run_id: str,
    policy: Input[Model],
    world: Input[Dataset],
    tasks: Input[Dataset],
    model: Output[Model],
    kept: Output[Dataset],
    metrics: Output[Metrics],
) -> NamedTuple("RSOutputs", [("model_uri", str)]):
    """Best-of-N rollouts on the tasks the policy solves only sometimes; SFT on the best of them."""
    import os
    import shutil
    from collections import namedtuple

    from components.rejection_sampling.recipe import run

    work = os.path.join(os.path.dirname(model.path), "rs-work")
    res = run(preset=preset, overrides=overrides, policy_model=policy.path, world=world.path, tasks_dir=tasks.path,
              parent_run_id=parent_run_id, model_out=model.path, work_dir=work)
    shutil.copytree(os.path.join(work, "kept"), kept.path, dirs_exist_ok=True)
    res.publish(metrics, model)
    return namedtuple("RSOutputs", ["model_uri"])(res.model_uri)
