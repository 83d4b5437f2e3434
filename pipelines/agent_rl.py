"""The agentrl pipeline (DESIGN.md §1):
configure -> sandbox_build -> prepare -> sft_warmup -> grpo -> rejection_sampling -> dpo -> evaluate -> promote (if
the gate says so). `configure` validates the whole run (preset, run form, overrides) before any work; each of
sft_warmup, grpo, rejection_sampling and dpo can be switched off in the run form (`run_sft`, ...), and then passes
its input model on (`dsl.If` / `dsl.Else` / `dsl.OneOf`). The training steps checkpoint under the parent run, so a
KFP retry of a task resumes where it stopped.

`build(plan, preset)` makes the pipeline with a placement plan (pipelines/placement.py) applied to every task and
the run form's defaults taken from `preset`; `agent_rl` is the one with the `local` plan and the tiny preset
(kfp.local, nothing cluster-specific).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from kfp import dsl

from components.dpo.component import dpo
from components.evaluation.component import evaluate, promote
from components.grpo.component import grpo
from components.prepare.component import configure, finish_run, prepare, skip_phase
from components.prepare.form import SWITCHES
from components.rejection_sampling.component import rejection_sampling
from components.sandbox.component import sandbox_build
from components.sft.component import sft_warmup
from pipelines.placement import Placement, fit_gpus, load_plan, placer
from pipelines.run_form import form_pipeline

PIPELINE_NAMES = {"agent_rl": "agentrl", "retrain": "agentrl-retrain"}


def configured(place, p: SimpleNamespace, pipeline: str):
    """The first task: validates the run and gives the overrides every phase gets (with the KFP run id that every
    MLflow run is tagged with)."""
    return place(configure(preset=p.preset, overrides=p.overrides, form=p.form_json, shown=p.form_shown,
                           pipeline=pipeline, base_model_uri=getattr(p, "base_model_uri", ""),
                           experiment=getattr(p, "experiment", ""), kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                           kfp_pipeline=PIPELINE_NAMES[pipeline]), "configure")


def with_exit_step(place, body: Callable[[SimpleNamespace], None], pipeline: str, preset: str, doc: str,
                   description: str):
    """The pipeline `pipeline` (its run form from `preset`): `body` inside a dsl.ExitHandler whose exit step
    (`finish_run`) ends the MLflow parent run with the pipeline's final state, whether it succeeded or failed."""

    def run(p: SimpleNamespace):
        exit_step = place(finish_run(kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, preset=p.preset, overrides=p.overrides,
                                     experiment=getattr(p, "experiment", ""), parent_run_id=p.parent_run_id),
                          "finish_run")
        with dsl.ExitHandler(exit_step, name=f"{PIPELINE_NAMES[pipeline]}-run"):
            body(p)

    run.__name__, run.__doc__ = pipeline, doc
    return form_pipeline(pipeline, preset, name=PIPELINE_NAMES[pipeline], description=description)(run)


def switched(place, on: Any, phase: str, ctx: dict[str, Any], policy: Any, task: Callable[[], Any]) -> Any:
    """`task()` when the run-form switch `on` is true, else a pass-through of `policy`; the model either gives."""
    switch, mlflow_phase = SWITCHES[phase]
    with dsl.If(on == True, name=f"{phase}-on"):  # noqa: E712 - a KFP condition
        ran = place(task(), phase)
    with dsl.Else(name=f"{phase}-off"):
        skipped = place(skip_phase(phase=mlflow_phase, switch=switch, preset=ctx["preset"], overrides=ctx["overrides"],
                                   parent_run_id=ctx["parent_run_id"], policy=policy), "skip_phase")
        skipped.set_display_name(f"{phase} (skipped)")
    return dsl.OneOf(ran.outputs["model"], skipped.outputs["model"])


def dpo_evaluate_promote(place, ctx: dict[str, Any], policy: Any, ab_logs_uri: Any, world: Any, tasks: Any,
                         run_dpo: Any = None) -> None:
    """The tail both pipelines share: DPO on A/B logs (switchable), evaluation, promotion behind the gate."""
    def dpo_task():
        return dpo(**ctx, ab_logs_uri=ab_logs_uri, policy=policy, world=world, tasks=tasks)

    model = switched(place, run_dpo, "dpo", ctx, policy, dpo_task) if run_dpo is not None else \
        place(dpo_task(), "dpo").outputs["model"]
    ev = place(evaluate(**ctx, model=model, world=world, tasks=tasks), "evaluate")
    with dsl.If(ev.outputs["promote"] == True, name="gate-passed"):  # noqa: E712 - a KFP condition
        place(promote(version=ev.outputs["version"], overrides=ctx["overrides"]), "promote")


def build(plan: dict[str, Placement], preset: str = "tiny"):
    from components.core.config import load_config

    # caching by intent: only `configure` (a pure function of the run form) may be served from KFP's cache; every
    # other task writes MLflow runs, checkpoints or the registry, or nests under this run's parent run
    place = placer(fit_gpus(plan, load_config(preset=preset)))

    def body(p: SimpleNamespace) -> None:
        overrides = configured(place, p, "agent_rl").outputs["overrides"]
        # The sandbox comes first: it is cheap, and its text is the embedded tokenizer's corpus.
        sandbox = place(sandbox_build(preset=p.preset, overrides=overrides, parent_run_id=p.parent_run_id),
                        "sandbox_build")
        prep = place(prepare(
            preset=p.preset, overrides=overrides, base_model_uri=p.base_model_uri, experiment=p.experiment,
            parent_run_id=sandbox.outputs["parent_run_id"], corpus=sandbox.outputs["corpus"],
        ), "prepare")
        ctx = dict(preset=p.preset, overrides=overrides, parent_run_id=sandbox.outputs["parent_run_id"])
        world, tasks = sandbox.outputs["world"], sandbox.outputs["tasks"]
        base = prep.outputs["base_model"]
        sft = switched(place, p.run_sft, "sft_warmup", ctx, base, lambda: sft_warmup(
            **ctx, base_model=base, demos=sandbox.outputs["demos"], world=world, tasks=tasks))
        rl = switched(place, p.run_grpo, "grpo", ctx, sft, lambda: grpo(
            **ctx, policy=sft, world=world, tasks=tasks))
        rs = switched(place, p.run_rejection_sampling, "rejection_sampling", ctx, rl, lambda: rejection_sampling(
            **ctx, policy=rl, world=world, tasks=tasks))
        dpo_evaluate_promote(place, ctx, rs, p.dpo_ab_logs_uri, world, tasks, run_dpo=p.run_dpo)

    return with_exit_step(place, body, "agent_rl", preset, "agentrl end to end.",
                          "Turn a base LLM into a tool-using agent: SFT warmup, sandbox, GRPO, rejection sampling, "
                          "DPO from A/B data, evaluation and promotion.")


agent_rl = build(load_plan("local"))
