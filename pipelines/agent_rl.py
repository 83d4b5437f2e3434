"""The agentrl pipeline (DESIGN.md §1). It grows as the phases land; today:
sandbox_build -> prepare -> sft_warmup -> grpo -> rejection_sampling -> dpo -> evaluate -> promote (if the
gate says so). The training steps checkpoint under the parent run, so a KFP retry of a task resumes where it
stopped.

`build(plan)` makes the pipeline with a placement plan (pipelines/placement.py) applied to every task;
`agent_rl` is the one with the `local` plan (kfp.local, nothing cluster-specific).
"""

from kfp import dsl

from components.dpo.component import dpo
from components.evaluation.component import evaluate, promote
from components.grpo.component import grpo
from components.prepare.component import prepare
from components.rejection_sampling.component import rejection_sampling
from components.sandbox.component import sandbox_build
from components.sft.component import sft_warmup
from pipelines.placement import Placement, load_plan, placer


def dpo_evaluate_promote(place, preset, overrides, parent, policy, ab_logs_uri, world, tasks) -> None:
    """The tail both pipelines share: DPO on A/B logs, evaluation, promotion behind the gate."""
    pref = place(dpo(
        preset=preset, overrides=overrides, parent_run_id=parent, ab_logs_uri=ab_logs_uri, policy=policy,
        world=world, tasks=tasks,
    ), "dpo")
    ev = place(evaluate(
        preset=preset, overrides=overrides, parent_run_id=parent, model=pref.outputs["model"], world=world,
        tasks=tasks,
    ), "evaluate")
    with dsl.If(ev.outputs["promote"] == True, name="gate-passed"):  # noqa: E712 - a KFP condition
        place(promote(version=ev.outputs["version"], overrides=overrides), "promote")


def build(plan: dict[str, Placement]):
    place = placer(plan)

    @dsl.pipeline(
        name="agentrl",
        description="Turn a base LLM into a tool-using agent: SFT warmup, sandbox, GRPO, rejection sampling, "
        "DPO from A/B data, evaluation and promotion.",
    )
    def agent_rl(
        base_model_uri: str = "",
        preset: str = "tiny",
        overrides: str = "",
        experiment: str = "agentrl",
        parent_run_id: str = "",
        dpo_ab_logs_uri: str = "",
    ):
        """agentrl end to end.

        Args:
            base_model_uri: the model to start from: a Hugging Face directory on the node, an s3:// prefix (any
                tool's upload), a .gguf file or 'smollm2-135m-instruct';
                empty = the preset's (the tiny preset builds its own model locally).
            preset: 'tiny' (CPU, minutes), 'small' (SmolLM2-135M-Instruct, CPU or one GPU) or 'h100' (cluster defaults).
            overrides: JSON object of config overrides, e.g. {"grpo": {"group_size": 16}}.
            experiment: MLflow experiment name.
            parent_run_id: an MLflow run to nest under; empty = create one (or use the KFP MLflow plugin's).
            dpo_ab_logs_uri: A/B deployment logs (ABRecord JSONL: a file, directory or s3:// prefix) for DPO;
                empty = simulate the A/B deployment in the sandbox.
        """
        # The sandbox comes first: it is cheap, and its text is the embedded tokenizer's corpus.
        sandbox = place(sandbox_build(preset=preset, overrides=overrides, parent_run_id=parent_run_id),
                        "sandbox_build")
        prep = place(prepare(
            preset=preset, overrides=overrides, base_model_uri=base_model_uri, experiment=experiment,
            parent_run_id=sandbox.outputs["parent_run_id"], corpus=sandbox.outputs["corpus"],
        ), "prepare")
        parent = sandbox.outputs["parent_run_id"]
        world, tasks = sandbox.outputs["world"], sandbox.outputs["tasks"]
        sft = place(sft_warmup(
            preset=preset, overrides=overrides, parent_run_id=parent, base_model=prep.outputs["base_model"],
            demos=sandbox.outputs["demos"], world=world, tasks=tasks,
        ), "sft_warmup")
        rl = place(grpo(
            preset=preset, overrides=overrides, parent_run_id=parent, policy=sft.outputs["model"], world=world,
            tasks=tasks,
        ), "grpo")
        rs = place(rejection_sampling(
            preset=preset, overrides=overrides, parent_run_id=parent, policy=rl.outputs["model"], world=world,
            tasks=tasks,
        ), "rejection_sampling")
        dpo_evaluate_promote(place, preset, overrides, parent, rs.outputs["model"], dpo_ab_logs_uri, world, tasks)

    return agent_rl


agent_rl = build(load_plan("local"))
