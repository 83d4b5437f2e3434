"""The agentrl pipeline (DESIGN.md §1). It grows as the phases land; today:
sandbox_build -> prepare -> sft_warmup -> rejection_sampling -> dpo -> evaluate -> promote (if the gate
says so). GRPO goes between sft_warmup and rejection_sampling when it lands."""

from kfp import dsl

from components.dpo.component import dpo
from components.evaluation.component import evaluate, promote
from components.prepare.component import prepare
from components.rejection_sampling.component import rejection_sampling
from components.sandbox.component import sandbox_build
from components.sft.component import sft_warmup


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
        base_model_uri: the model to start from: a Hugging Face directory on the node or an s3:// URI;
            empty = the preset's (the tiny preset builds its own model locally).
        preset: 'tiny' (CPU, minutes) or 'h100' (cluster defaults).
        overrides: JSON object of config overrides, e.g. {"grpo": {"group_size": 16}}.
        experiment: MLflow experiment name.
        parent_run_id: an MLflow run to nest under; empty = create one (or use the KFP MLflow plugin's).
        dpo_ab_logs_uri: A/B deployment logs (ABRecord JSONL: a file, directory or s3:// prefix) for DPO;
            empty = simulate the A/B deployment in the sandbox.
    """
    # The sandbox comes first: it is cheap, and its text is the embedded tokenizer's corpus.
    sandbox = sandbox_build(preset=preset, overrides=overrides, parent_run_id=parent_run_id)
    sandbox.set_display_name("sandbox_build")
    prep = prepare(
        preset=preset, overrides=overrides, base_model_uri=base_model_uri, experiment=experiment,
        parent_run_id=sandbox.outputs["parent_run_id"], corpus=sandbox.outputs["corpus"],
    )
    prep.set_display_name("prepare")
    parent = sandbox.outputs["parent_run_id"]
    sft = sft_warmup(
        preset=preset, overrides=overrides, parent_run_id=parent, base_model=prep.outputs["base_model"],
        demos=sandbox.outputs["demos"], world=sandbox.outputs["world"], tasks=sandbox.outputs["tasks"],
    )
    sft.set_display_name("sft_warmup")
    rs = rejection_sampling(
        preset=preset, overrides=overrides, parent_run_id=parent, policy=sft.outputs["model"],
        world=sandbox.outputs["world"], tasks=sandbox.outputs["tasks"],
    )
    rs.set_display_name("rejection_sampling")
    pref = dpo(
        preset=preset, overrides=overrides, parent_run_id=parent, ab_logs_uri=dpo_ab_logs_uri,
        policy=rs.outputs["model"], world=sandbox.outputs["world"], tasks=sandbox.outputs["tasks"],
    )
    pref.set_display_name("dpo")
    ev = evaluate(
        preset=preset, overrides=overrides, parent_run_id=parent, model=pref.outputs["model"],
        world=sandbox.outputs["world"], tasks=sandbox.outputs["tasks"],
    )
    ev.set_display_name("evaluate")
    with dsl.If(ev.outputs["promote"] == True, name="gate-passed"):  # noqa: E712 - a KFP condition, not Python
        promote(version=ev.outputs["version"], overrides=overrides).set_display_name("promote")
