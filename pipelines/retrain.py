"""Scheduled retraining (DESIGN.md §1): the registry's `champion` + new A/B logs -> (optionally a short GRPO
refresh) -> DPO -> evaluation -> promotion behind the gate. `agentrl schedule` runs it on a cron;
`build(plan)` applies a placement plan."""

from kfp import dsl

from components.evaluation.component import champion
from components.grpo.component import grpo
from components.sandbox.component import sandbox_build
from pipelines.agent_rl import dpo_evaluate_promote
from pipelines.placement import Placement, load_plan, placer


def build(plan: dict[str, Placement]):
    place = placer(plan)

    @dsl.pipeline(
        name="agentrl-retrain",
        description="Scheduled retraining: the champion and new A/B deployment logs -> (GRPO refresh) -> DPO -> "
        "evaluation -> promotion.",
    )
    def retrain(
        ab_logs_uri: str,
        preset: str = "tiny",
        overrides: str = "",
        parent_run_id: str = "",
        grpo_refresh: bool = False,
    ):
        """Retrain the champion on new A/B feedback.

        Args:
            ab_logs_uri: the new A/B deployment logs (ABRecord JSONL: a file, directory or s3:// prefix).
            preset: 'tiny' (CPU, minutes), 'small' (SmolLM2-135M-Instruct, CPU or one GPU) or 'h100' (cluster defaults).
            overrides: JSON object of config overrides, e.g. {"dpo": {"beta": 0.2}}.
            parent_run_id: an MLflow run to nest under; empty = create one (or use the KFP MLflow plugin's).
            grpo_refresh: run a short GRPO phase on the champion before DPO (size it with overrides, e.g.
                {"grpo": {"steps": 50}}); off = DPO straight from the champion.
        """
        # the sandbox gives the held-out suites the candidate and the champion are measured on
        sandbox = place(sandbox_build(preset=preset, overrides=overrides, parent_run_id=parent_run_id),
                        "sandbox_build")
        champ = place(champion(overrides=overrides), "champion")
        parent = sandbox.outputs["parent_run_id"]
        world, tasks = sandbox.outputs["world"], sandbox.outputs["tasks"]
        with dsl.If(grpo_refresh == True, name="grpo-refresh"):  # noqa: E712 - a KFP condition
            rl = place(grpo(preset=preset, overrides=overrides, parent_run_id=parent, policy=champ.outputs["model"],
                            world=world, tasks=tasks), "grpo")
            dpo_evaluate_promote(place, preset, overrides, parent, rl.outputs["model"], ab_logs_uri, world, tasks)
        with dsl.Else(name="no-refresh"):
            dpo_evaluate_promote(place, preset, overrides, parent, champ.outputs["model"], ab_logs_uri, world,
                                 tasks)

    return retrain


retrain = build(load_plan("local"))
