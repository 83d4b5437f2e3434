"""Scheduled retraining (DESIGN.md §1): the registry's `champion` + new A/B logs -> DPO -> evaluation ->
promotion behind the gate. `agentrl schedule` runs it on a cron; `build(plan)` applies a placement plan."""

from kfp import dsl

from components.dpo.component import dpo
from components.evaluation.component import champion, evaluate, promote
from components.sandbox.component import sandbox_build
from pipelines.placement import Placement, apply, load_plan


def build(plan: dict[str, Placement]):
    def place(task, phase: str):
        task.set_display_name(phase)
        return apply(task, plan[phase])

    @dsl.pipeline(
        name="agentrl-retrain",
        description="Scheduled retraining: the champion and new A/B deployment logs -> DPO -> evaluation -> promotion.",
    )
    def retrain(
        ab_logs_uri: str,
        preset: str = "tiny",
        overrides: str = "",
        parent_run_id: str = "",
    ):
        """Retrain the champion on new A/B feedback.

        Args:
            ab_logs_uri: the new A/B deployment logs (ABRecord JSONL: a file, directory or s3:// prefix).
            preset: 'tiny' (CPU, minutes) or 'h100' (cluster defaults).
            overrides: JSON object of config overrides, e.g. {"dpo": {"beta": 0.2}}.
            parent_run_id: an MLflow run to nest under; empty = create one (or use the KFP MLflow plugin's).
        """
        # the sandbox gives the held-out suites the candidate and the champion are measured on
        sandbox = place(sandbox_build(preset=preset, overrides=overrides, parent_run_id=parent_run_id),
                        "sandbox_build")
        champ = place(champion(overrides=overrides), "champion")
        parent = sandbox.outputs["parent_run_id"]
        world, tasks = sandbox.outputs["world"], sandbox.outputs["tasks"]
        pref = place(dpo(
            preset=preset, overrides=overrides, parent_run_id=parent, ab_logs_uri=ab_logs_uri,
            policy=champ.outputs["model"], world=world, tasks=tasks,
        ), "dpo")
        ev = place(evaluate(
            preset=preset, overrides=overrides, parent_run_id=parent, model=pref.outputs["model"], world=world,
            tasks=tasks,
        ), "evaluate")
        with dsl.If(ev.outputs["promote"] == True, name="gate-passed"):  # noqa: E712 - a KFP condition
            place(promote(version=ev.outputs["version"], overrides=overrides), "promote")

    return retrain


retrain = build(load_plan("local"))
