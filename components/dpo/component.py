"""KFP wrapper for `dpo`: the body only imports the phase and calls `run`."""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components.core import images


@dsl.component(base_image=images.TRAINER, install_kfp_package=False)
def dpo(
    preset: str,
    overrides: str,
    parent_run_id: str,
    ab_logs_uri: str,
    policy: Input[Model],
    world: Input[Dataset],
    tasks: Input[Dataset],
    model: Output[Model],
    pairs: Output[Dataset],
    metrics: Output[Metrics],
) -> NamedTuple("DPOOutputs", [("model_uri", str)]):
    """DPO on preference pairs from A/B logs (`ab_logs_uri`, or simulated in the sandbox when empty)."""
    import os
    import shutil
    from collections import namedtuple

    from components.dpo.recipe import run

    work = os.path.join(os.path.dirname(model.path), "dpo-work")
    res = run(preset=preset, overrides=overrides, policy_model=policy.path, ab_logs=ab_logs_uri, world=world.path,
              tasks_dir=tasks.path, parent_run_id=parent_run_id, model_out=model.path, work_dir=work)
    shutil.copytree(os.path.join(work, "pairs"), pairs.path, dirs_exist_ok=True)
    res.publish(metrics, model)
    return namedtuple("DPOOutputs", ["model_uri"])(res.model_uri)
