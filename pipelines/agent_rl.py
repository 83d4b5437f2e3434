"""The agentrl pipeline (DESIGN.md §1). It grows as the phases land; today:
sandbox_build -> prepare -> sft_warmup -> evaluate -> promote (if the gate says so)."""

from kfp import dsl

from components.evaluation.component import evaluate, promote
from components.prepare.component import prepare
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
):
    """agentrl end to end.

    Args:
        base_model_uri: the model to start from: a Hugging Face directory on the node or an s3:// URI;
            empty = the preset's (the tiny preset builds its own model locally).
        preset: 'tiny' (CPU, minutes) or 'h100' (cluster defaults).
        overrides: JSON object of config overrides, e.g. {"grpo": {"group_size": 16}}.
        experiment: MLflow experiment name.
        parent_run_id: an MLflow run to nest under; empty = create one (or use the KFP MLflow plugin's).
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
    ev = evaluate(
        preset=preset, overrides=overrides, parent_run_id=parent, model=sft.outputs["model"],
        world=sandbox.outputs["world"], tasks=sandbox.outputs["tasks"],
    )
    ev.set_display_name("evaluate")
    with dsl.If(ev.outputs["promote"] == True, name="gate-passed"):  # noqa: E712 - a KFP condition, not Python
        promote(version=ev.outputs["version"], overrides=overrides).set_display_name("promote")
