"""Scheduled retraining (DESIGN.md §1): the registry's `champion` + new A/B logs -> (optionally a short GRPO
refresh) -> DPO -> evaluation -> promotion behind the gate. `agentrl schedule` runs it on a cron;
`build(plan, preset)` applies a placement plan and takes the run form's defaults from the preset."""

from __future__ import annotations

from types import SimpleNamespace

from kfp import dsl

from components.evaluation.component import champion
from components.grpo.component import grpo
from components.sandbox.component import sandbox_build
from pipelines.agent_rl import configured, dpo_evaluate_promote, with_exit_step
from pipelines.placement import Placement, fit_gpus, load_plan, placer


def build(plan: dict[str, Placement], preset: str = "tiny"):
    from components.core.config import load_config

    # a scheduled retrain with the same parameters must retrain: no task of it is served from KFP's cache
    place = placer(fit_gpus(plan, load_config(preset=preset)), cache=False)

    def body(p: SimpleNamespace) -> None:
        overrides = configured(place, p, "retrain").outputs["overrides"]
        # the sandbox gives the held-out suites the candidate and the champion are measured on
        sandbox = place(sandbox_build(preset=p.preset, overrides=overrides, parent_run_id=p.parent_run_id),
                        "sandbox_build")
        champ = place(champion(overrides=overrides), "champion")
        ctx = dict(preset=p.preset, overrides=overrides, parent_run_id=sandbox.outputs["parent_run_id"])
        world, tasks = sandbox.outputs["world"], sandbox.outputs["tasks"]
        with dsl.If(p.grpo_refresh == True, name="grpo-refresh"):  # noqa: E712 - a KFP condition
            rl = place(grpo(**ctx, policy=champ.outputs["model"], world=world, tasks=tasks), "grpo")
            dpo_evaluate_promote(place, ctx, rl.outputs["model"], p.ab_logs_uri, world, tasks)
        with dsl.Else(name="no-refresh"):
            dpo_evaluate_promote(place, ctx, champ.outputs["model"], p.ab_logs_uri, world, tasks)

    return with_exit_step(place, body, "retrain", preset, "Retrain the champion on new A/B feedback.",
                          "Scheduled retraining: the champion and new A/B deployment logs -> (GRPO refresh) -> DPO -> "
                          "evaluation -> promotion.")


retrain = build(load_plan("local"))
