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
   held-out easy suite with the evaluation phase's code.

`train_sft` is the reusable piece: rejection sampling trains with it too.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.core import storage
from components.core.checkpoint import TrainerCheckpoints, phase_root, train_or_resume
from components.core.config import SFTConfig
from components.core.policy import Policy, load_policy, save_policy, save_tokenizer, trainable_lora
from components.core.schema import ModelCard, Trajectory, read_jsonl
from components.core.tracking import PhaseRun, phase_run, rank, setup_phase

PHASE = "sft"


@dataclass
class SFTResult:
    parent_run_id: str
    run_id: str
    model_dir: str
    model_uri: str
    metrics: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def messages(traj: Trajectory) -> list[dict[str, str]]:
    return [{"role": t.role, "content": t.text} for t in traj.turns]


def demo_example(traj: Trajectory) -> dict[str, Any]:
    """prompt = system + user; completion = every later turn (loss on its assistant turns only)."""
    msgs = messages(traj)
    return {"prompt": msgs[:2], "completion": msgs[2:]}


def error_example(good: Trajectory, failed: Trajectory) -> dict[str, Any] | None:
    """STaR-style: the failed first action and its observation in the prompt, the expert's turns after it."""
    bad = messages(failed)
    if len(bad) < 4 or bad[2]["role"] != "assistant":
        return None
    return {"prompt": bad[:4], "completion": messages(good)[2:]}


def load_demos(uri: str) -> list[Trajectory]:
    reader = read_jsonl(uri, Trajectory)
    trajs = [t for t in reader if t.verdict.success]
    if not trajs:
        raise ValueError(f"sft.data_uri={uri!r}: no successful trajectories to learn from")
    return trajs


def tokenize_example(tokenizer: Any, example: dict[str, Any]) -> dict[str, list[int]]:
    """input_ids and assistant_masks (1 = a token of an assistant turn of the completion)."""
    from components.core.tokens import encode_messages

    prompt, completion = example["prompt"], example["completion"]
    ids, mask = encode_messages(tokenizer, prompt + completion, train_from=len(prompt))
    return {"input_ids": ids, "assistant_masks": mask}


def build_dataset(examples: list[dict[str, Any]], seed: int, tokenizer: Any):
    """Shuffled, pre-tokenised examples: TRL builds its labels from `assistant_masks` (-100 elsewhere)."""
    from datasets import Dataset

    rng = random.Random(seed)
    examples = list(examples)
    rng.shuffle(examples)
    return Dataset.from_list([tokenize_example(tokenizer, ex) for ex in examples])


def deepspeed_config(name: str | None, bf16: bool) -> dict[str, Any] | str | None:
    """DeepSpeed ZeRO presets ('zero1' | 'zero2' | 'zero3') or a user's JSON file."""
    if name is None or name.endswith(".json"):
        return name
    stage = int(name[-1])
    cfg: dict[str, Any] = {
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "train_batch_size": "auto",
        "bf16": {"enabled": "auto" if bf16 else False},
    }
    if stage == 3:
        cfg["zero_optimization"].update({"stage3_gather_16bit_weights_on_model_save": True,
                                         "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto"})
    return cfg


# ----------------------------------------------------------------------------------------------
# Training (reused by rejection sampling)
# ----------------------------------------------------------------------------------------------
class Clock:
    """The training's wall clock: started when the first step begins (not while the data is tokenised).
    `spent_before`: seconds an earlier attempt trained (a resumed run has only the rest of the budget)."""

    def __init__(self, max_minutes: float | None, spent_before: float = 0.0) -> None:
        self.budget_s = max_minutes * 60 if max_minutes is not None else None
        self.spent_before = spent_before
        self.started: float | None = None

    def start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def spent(self) -> float:
        """Seconds trained, this attempt and the ones before it."""
        return self.spent_before + (time.monotonic() - self.started if self.started is not None else 0.0)

    def fraction(self) -> float:
        """Share of the budget spent (0 without a budget or before the start)."""
        if self.budget_s is None or self.started is None:
            return 0.0
        return self.spent() / self.budget_s


def budget_cosine(clock: Clock, total_steps: int, warmup: float) -> Any:
    """LR multiplier for a cosine whose progress is max(steps done / steps planned, budget spent).

    A wall-clock budget that ends training before the planned epochs otherwise stops a cosine half way,
    at a high learning rate; here the rate anneals to zero by whichever end comes first.
    """
    import math

    def factor(step: int) -> float:
        progress = min(1.0, max(step / max(1, total_steps), clock.fraction()))
        if progress < warmup:
            return max(progress / warmup, 1e-3)
        return 0.5 * (1.0 + math.cos(math.pi * (progress - warmup) / max(1e-9, 1.0 - warmup)))

    return factor


def epoch_seeded(sampler: Any, seed: int) -> Any:
    """HF's length-grouped sampler draws each epoch's order from the global RNG, which a resumed run does not
    have in the same state: here each epoch's order comes from (seed, epoch), so a resume sees the same data."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    if type(sampler) is not LengthGroupedSampler:
        return sampler

    class EpochSeeded(LengthGroupedSampler):
        def set_epoch(self, epoch: int) -> None:  # accelerate's data loader calls it before every epoch
            self.generator = torch.Generator().manual_seed(seed * 100_003 + epoch)

    out = EpochSeeded(sampler.batch_size, lengths=sampler.lengths)
    out.set_epoch(0)
    return out


def _callbacks(tracker: PhaseRun | None, clock: Clock | None = None, prefix: str = "", resumed: bool = False):
    """MLflow logging and the wall-clock budget. A resumed run re-trains the steps after its checkpoint,
    which the attempt before it may have logged already: those steps are not logged twice."""
    from transformers import TrainerCallback

    clock = clock or Clock(None)

    class Track(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if tracker is None or not logs:
                return
            vals = {prefix + k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}
            (tracker.log_new_metrics if resumed else tracker.log_metrics)(vals, step=state.global_step)

    class Budget(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.start()

        def on_step_end(self, args, state, control, **kw):
            if clock.fraction() >= 1.0:
                control.should_training_stop = True

    return [Track(), Budget()]


def train_sft(
    policy: Policy,
    examples: list[dict[str, Any]],
    sft: SFTConfig,
    out_dir: str | os.PathLike,
    seed: int = 0,
    tracker: PhaseRun | None = None,
    use_cpu: bool = True,
    metric_prefix: str = "",
    save_to: str | os.PathLike | None = None,
    checkpoints: TrainerCheckpoints | None = None,
) -> dict[str, float]:
    """Fine-tune `policy.model` in place on conversational prompt/completion examples.

    With `checkpoints`, the Trainer's checkpoints are published to storage as it saves them, and a newer
    one left by an earlier attempt is resumed from (steps, optimizer, scheduler, RNG, budget spent)."""
    from trl import SFTConfig as TRLSFTConfig
    from trl import SFTTrainer

    dataset = build_dataset(examples, seed, policy.tokenizer)
    args = TRLSFTConfig(
        output_dir=str(out_dir), num_train_epochs=sft.epochs, max_steps=sft.max_steps,
        per_device_train_batch_size=sft.batch_size, gradient_accumulation_steps=sft.gradient_accumulation_steps,
        learning_rate=sft.learning_rate, warmup_steps=sft.warmup_ratio,  # a float < 1 is a ratio
        weight_decay=sft.weight_decay,
        max_grad_norm=sft.max_grad_norm, lr_scheduler_type="cosine", logging_steps=sft.logging_steps,
        max_length=sft.max_seq_len, bf16=sft.bf16,
        gradient_checkpointing=sft.gradient_checkpointing, deepspeed=deepspeed_config(sft.deepspeed, sft.bf16),
        use_cpu=use_cpu, report_to="none", seed=seed, data_seed=seed,
        dataloader_num_workers=0, disable_tqdm=False, train_sampling_strategy="group_by_length",  # less padding
        **(checkpoints.trainer_args() if checkpoints else {"save_strategy": "no"}),
    )
    resumed = checkpoints is not None and checkpoints.resume_from() is not None
    clock = Clock(sft.max_minutes, spent_before=checkpoints.state.get("train_seconds", 0.0) if resumed else 0.0)
    callbacks = _callbacks(tracker, clock, metric_prefix, resumed=resumed)
    if checkpoints is not None:
        callbacks.append(checkpoints.callback(lambda: {
            "run_id": getattr(tracker, "run_id", None), "parent_run_id": getattr(tracker, "parent_run_id", None),
            "train_seconds": clock.spent()}))

    class Trainer(SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return epoch_seeded(super()._get_train_sampler(train_dataset), seed)

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if sft.max_minutes is None:
                return super().create_scheduler(num_training_steps, optimizer)
            from torch.optim.lr_scheduler import LambdaLR

            if self.lr_scheduler is None:
                opt = optimizer if optimizer is not None else self.optimizer
                self.lr_scheduler = LambdaLR(opt, budget_cosine(clock, num_training_steps, sft.warmup_ratio))
            return self.lr_scheduler

    trainer = Trainer(model=policy.model, args=args, train_dataset=dataset, processing_class=policy.tokenizer,
                      callbacks=callbacks)
    loss, steps, resumed_from = train_or_resume(trainer, checkpoints)
    seconds = clock.spent()
    tokens = sum(len(x) for x in trainer.train_dataset["input_ids"])
    if save_to is not None:
        # collective under DDP / DeepSpeed ZeRO-3 (gathers the shards); every rank must call it
        trainer.save_model(str(save_to))
    policy.model.eval()
    if trainer.is_deepspeed_enabled:  # models loaded later in this process (evaluation) must not be ZeRO-3 partitioned
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    return {"train_loss": float(loss), "train_seconds": seconds, "train_steps": float(steps),
            "train_examples": float(len(dataset)), "train_tokens_per_epoch": float(tokens),
            "world_size": float(args.world_size), "deepspeed": float(bool(trainer.is_deepspeed_enabled)),
            "resumed_from": float(resumed_from)}


# ----------------------------------------------------------------------------------------------
# The phase
# ----------------------------------------------------------------------------------------------
def run(
    preset: str = "tiny",
    overrides: str = "",
    base_model: str = "",
    demos: str = "",
    tasks_dir: str = "",
    world: str = "",
    parent_run_id: str | None = None,
    model_out: str | None = None,
    base_model_ref: str = "",
) -> SFTResult:
    """`base_model_ref`: a URI of the base that resolves on any machine (the stored copy), named as a LoRA
    adapter's base in its card; default: `base_model`."""
    cfg, home, storage_root = setup_phase(preset, overrides)  # validated before any work
    data_uri = cfg.sft.data_uri or (storage.join(demos, "train.jsonl") if demos else "")
    if not data_uri:
        raise ValueError("sft: no demonstrations — set sft.data_uri or give the sandbox_build demos")
    base_uri = base_model or cfg.model.base_uri
    # checkpoints where a KFP retry of this step finds them (they depend on the parent run, not the attempt)
    ckpts = TrainerCheckpoints(phase_root(storage_root, parent_run_id, PHASE, cfg.sft.checkpoint_uri),
                               home / "staging" / PHASE / (parent_run_id or "standalone") / f"rank{rank()}",
                               cfg.sft.checkpoint_every,
                               cfg.sft.keep_checkpoints, cfg.sft.resume)
    with phase_run(PHASE, config=cfg, parent_run_id=parent_run_id or ckpts.state.get("parent_run_id") or None,
                   close_parent=False, resume_run_id=ckpts.state.get("run_id")) as tracker:
        if ckpts.step:
            tracker.set_tags({"agentrl.sft.resumed_from": str(ckpts.step)})
        trajs = load_demos(data_uri)
        examples = [demo_example(t) for t in trajs]
        n_error = 0
        if cfg.sft.error_examples:
            from components.sft.errors import error_examples

            extra = error_examples(trajs, cfg, tasks_dir)
            examples += extra
            n_error = len(extra)
        tracker.log_metrics({"demos": len(trajs), "error_examples": n_error}, step=0)

        policy = load_policy(base_uri, dtype="bfloat16" if cfg.sft.bf16 else "float32", trainable=True,
                             cache=home / "cache", model_cfg=cfg.model)
        if cfg.model.lora.enabled:
            policy = trainable_lora(policy, cfg.model.lora)
        if cfg.sft.torch_threads and cfg.run.torch_device() != "cuda":
            from components.core.tiny import set_torch_threads

            set_torch_threads(cfg.sft.torch_threads)
        work = Path(os.environ.get("AGENTRL_SFT_WORKDIR") or home / "runs" / tracker.run_id / PHASE)
        # several processes, or ZeRO (whose module holds shards even in one process): the trainer saves collectively
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or bool(cfg.sft.deepspeed)
        out = Path(model_out) if model_out else work / "model"
        stats = train_sft(policy, examples, cfg.sft, work / "trainer", cfg.run.seed, tracker,
                          use_cpu=cfg.run.torch_device() != "cuda", save_to=out if distributed else None, checkpoints=ckpts)
        if rank() != 0:
            return None  # rank 0 saves, measures and tracks
        tracker.log_metrics(stats, step=int(stats["train_steps"]))
        card = ModelCard(base_model=base_uri, phase=PHASE, parent_run_id=tracker.parent_run_id, run_id=tracker.run_id,
                         extra={"base_uri": base_model_ref or base_uri, "demos": data_uri,
                                "lora": cfg.model.lora.enabled})
        if distributed:  # the weights were written collectively; add the tokenizer and the card
            save_tokenizer(policy.tokenizer, out)
            card.kind = "lora" if policy.is_lora else "full"
            (out / "agentrl.json").write_text(json.dumps(_card_record(card), indent=1))
        else:
            save_policy(policy, out, card, merge=False)
        metrics = dict(stats)
        if cfg.sft.eval_suites:
            from components.evaluation.evaluate import quick_eval

            held = quick_eval(str(out), cfg, tasks_dir or None, cfg.sft.eval_suites, world or None)
            metrics.update(held)
            tracker.log_metrics(held, step=int(stats["train_steps"]))
            card.metrics = {k: float(v) for k, v in held.items()}
            (out / "agentrl.json").write_text(json.dumps(_card_record(card), indent=1))
        uri = tracker.store_model(out, storage_root)
        return SFTResult(tracker.parent_run_id, tracker.run_id, str(out), uri, metrics)


def run_distributed(nproc: int, **kwargs: Any) -> SFTResult:
    """Run the phase over `nproc` processes with torchrun (one per GPU; gloo on CPU for tests)."""
    from components.core.launch import run_torchrun

    return SFTResult(**run_torchrun("components.sft", nproc, kwargs, "AGENTRL_SFT_WORKDIR"))


def run_multi_node(**kwargs: Any) -> SFTResult:
    """Run the phase as a multi-node TrainJob/PyTorchJob (sft.multi_node) and wait for it."""
    from components.core.config import load_config
    from components.core.launch import run_as_job

    cfg = load_config(preset=kwargs.get("preset") or None, overrides_json=kwargs.get("overrides") or None)
    return SFTResult(**run_as_job("components.sft", PHASE, cfg.sft.multi_node, cfg.storage.root, kwargs,
                                  ("base_model", "demos", "tasks_dir"), {"world": "world.json"}))


def gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        return 0


def _card_record(card: ModelCard) -> dict[str, Any]:
    from components.core.schema import to_record

    return to_record(card)

