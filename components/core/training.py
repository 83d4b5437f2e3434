"""The shared training kit: what every phase that fine-tunes a policy with a Hugging Face Trainer uses.

- `train_sft`: supervised fine-tuning on conversational prompt/completion examples with TRL's SFTTrainer, loss on
  the agent's own tokens only (masks from `core.tokens`), a wall-clock budget whose cosine anneals by whichever end
  comes first, an epoch-seeded sampler (a resumed run sees the same data), MLflow logging and published checkpoints.
  SFT warmup, rejection sampling and any supervised repair train with it.
- `callbacks`, `deepspeed_config`, `gpus`: the pieces DPO's and GRPO's trainers share.
"""

from __future__ import annotations

import os
import random
import time
from typing import TYPE_CHECKING, Any

from components.core.checkpoint import TrainerCheckpoints, train_or_resume

if TYPE_CHECKING:
    from components.core.config import SFTConfig
    from components.core.policy import Policy
    from components.core.tracking import PhaseRun


def gpus() -> int:
    """CUDA devices this process sees (0 without torch or CUDA)."""
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        return 0


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


def callbacks(tracker: PhaseRun | None, clock: Clock | None = None, prefix: str = "", resumed: bool = False):
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
    cbs = callbacks(tracker, clock, metric_prefix, resumed=resumed)
    if checkpoints is not None:
        cbs.append(checkpoints.callback(lambda: {
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
                      callbacks=cbs)
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
