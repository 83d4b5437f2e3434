"""SFT warmup, top to bottom (TRL's SFTTrainer does the training).

1. Resolve the config; open the phase run.
2. Read expert trajectories (sandbox demos, or any Trajectory JSONL file/dir/S3 URI) and turn them into
   conversational prompt/completion examples: the loss falls on the agent's own turns only. Each
   example is tokenised with the masks of `core.tokens` (the template's incremental rendering: any stock
   instruct template, no {% generation %} marker), the same ids a rollout samples; system, user and
   observation tokens, and assistant turns in the prompt (a failed attempt shown as context), are masked.
3. Optionally add error-example supervision (STaR-style rationalisation): a failed attempt and its
   error observation in the prompt, the corrected turns as the completion — the model learns to
   recover, never to make the mistake.
4. Load the base policy (full fine-tune, or a LoRA adapter on it), train with a wall-clock budget,
   metrics to MLflow every logging step, a checkpoint to storage every `sft.checkpoint_every` steps; a
   retried step (KFP retry after preemption) resumes from the newest one instead of starting over.
5. Save the model (with `agentrl.json`), store it under the run's prefix, and measure it on the
   held-out easy suite (`core.evaluate`).

The training itself is `core.training.train_sft`, which rejection sampling trains with too.
"""

from __future__ import annotations

import json
import os
from typing import Any, Unpack

from components.core import storage
from components.core.config import load_config
from components.core.phase import PhaseContext, PhaseResult, Places
from components.core.phase import launch as launch_phase
from components.core.policy import save_policy, save_tokenizer
from components.core.recovery import recovery_examples
from components.core.schema import Trajectory, read_jsonl, to_record
from components.core.tokens import demo_example
from components.core.tracking import rank
from components.core.training import gpus, train_sft
from components.sft.errors import error_examples

PHASE = "sft"


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def load_demos(uri: str) -> list[Trajectory]:
    reader = read_jsonl(uri, Trajectory)
    trajs = [t for t in reader if t.verdict.success]
    if not trajs:
        raise ValueError(f"sft.data_uri={uri!r}: no successful trajectories to learn from")
    return trajs


# ----------------------------------------------------------------------------------------------
# The phase
# ----------------------------------------------------------------------------------------------
def run(preset: str = "tiny", overrides: str = "", base_model: str = "", demos: str = "", base_model_ref: str = "",
        **places: Unpack[Places]) -> PhaseResult:
    """`base_model_ref`: a URI of the base that resolves on any machine (the stored copy), named as a LoRA
    adapter's base in its card; default: `base_model`."""
    ctx = PhaseContext.setup(PHASE, preset, overrides, **places)  # validated before any work
    cfg = ctx.cfg
    data_uri = cfg.sft.data_uri or (storage.join(demos, "train.jsonl") if demos else "")
    if not data_uri:
        raise ValueError("sft: no demonstrations — set sft.data_uri or give the sandbox_build demos")
    base_uri = base_model or cfg.model.base_uri
    ckpts = ctx.trainer_checkpoints(cfg.sft.checkpoint_every, cfg.sft.keep_checkpoints, cfg.sft.resume,
                                    cfg.sft.checkpoint_uri, per_rank=True)
    with ctx.open(resume=ckpts.state) as tracker:
        if ckpts.step:
            tracker.set_tags({"agentrl.sft.resumed_from": str(ckpts.step)})
        # 2-3. the examples: the demos, and error examples (a failed attempt in the prompt, the correction after it)
        trajs = load_demos(data_uri)
        examples = [demo_example(t) for t in trajs]
        extra = error_examples(trajs, ctx.environment(), cfg.run.seed) if cfg.sft.error_examples else []
        recovery = recovery_examples(trajs, ctx.environment(), cfg.run.seed, cfg.sft.recovery_ratio)
        examples += extra + recovery
        tracker.log_metrics({"demos": len(trajs), "error_examples": len(extra), "recovery_examples": len(recovery)},
                            step=0)

        # 4. train
        policy = ctx.load_policy(base_uri, base_model=True)
        ctx.use_threads(cfg.sft.torch_threads)
        # several processes, or ZeRO (whose module holds shards even in one process): the trainer saves collectively
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or bool(cfg.sft.deepspeed)
        out = ctx.out
        stats = train_sft(policy, examples, cfg.sft, ctx.work / "trainer", cfg.run.seed, tracker,
                          use_cpu=cfg.run.torch_device() != "cuda", save_to=out if distributed else None, checkpoints=ckpts)
        if rank() != 0:
            return None  # rank 0 saves, measures and tracks
        tracker.log_metrics(stats, step=int(stats["train_steps"]))

        # 5. save, measure, store
        card = ctx.card(base_uri, base_uri=base_model_ref or base_uri, demos=data_uri, lora=cfg.model.lora.enabled)
        if distributed:  # the weights were written collectively; add the tokenizer and the card
            save_tokenizer(policy.tokenizer, out)
            card.kind = "lora" if policy.is_lora else "full"
            (out / "agentrl.json").write_text(json.dumps(to_record(card), indent=1))
        else:
            save_policy(policy, out, card, merge=False)
        metrics = dict(stats)
        if cfg.sft.eval_suites:
            held = ctx.quick_eval(str(out), cfg.sft.eval_suites)
            metrics.update(held)
            tracker.log_metrics(held, step=int(stats["train_steps"]))
            card.metrics = {k: float(v) for k, v in held.items()}
            (out / "agentrl.json").write_text(json.dumps(to_record(card), indent=1))
        return ctx.finish(out, None, metrics)


def launch(processes: int | None = None, **kwargs: Any) -> PhaseResult:
    """The phase as its config asks: a multi-node TrainJob (sft.multi_node), one process per GPU of the pod under
    torchrun (DeepSpeed ZeRO per the preset; `processes`: default, the GPUs this pod sees), or this process."""
    cfg = load_config(preset=kwargs.get("preset") or None, overrides_json=kwargs.get("overrides") or None)
    n = gpus() if processes is None else processes
    return launch_phase("components.sft", run, kwargs, cfg.sft.multi_node, n, ("base_model", "demos", "tasks_dir"),
                        {"world": "world.json"}, cfg.storage.root)
