"""Checkpoints that a preempted pod can trust: `<root>/step-00000042/`, complete only once its manifest is.

A checkpoint is whatever the trainer saves — GRPO: what `accelerate` saves (weights or adapter, optimizer,
scheduler, RNG states; the ZeRO shards under DeepSpeed); SFT, rejection sampling and DPO: the Hugging Face
Trainer's `checkpoint-N` directory — plus a JSON state (step, MLflow run id, and what the phase adds:
curriculum, monitor, time spent...). It is written to a local staging directory and then published with
`storage.put_dir`, which writes the manifest last (a rename locally, the last object on S3). On start,
the newest step with a manifest wins; a half-written one is ignored, never loaded.

The root depends on the parent run and the phase, not on the attempt: a KFP retry of a preempted step
finds the checkpoints of the attempt before it (`phase_root`).
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.core import storage

STATE = "trainer_state.json"  # GRPO's state file; the HF phases use HF_STATE (HF owns trainer_state.json)
HF_STATE = "agentrl_state.json"
_STEP = re.compile(r"step-(\d{8})$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def phase_root(storage_root: str, parent_run_id: str | None, phase: str, override: str | None = None) -> str:
    """Where a phase checkpoints: the same URI on every attempt of one pipeline run's step. A run with no
    parent run and no explicit `checkpoint_uri` gets a fresh place: nothing identifies an earlier attempt
    of it, and a by-hand rerun must not silently continue another run."""
    if override:
        return override
    return storage.join(storage_root, "checkpoints", parent_run_id or f"standalone-{uuid.uuid4().hex[:12]}", phase)


class Checkpoints:
    def __init__(self, root: str, staging: str | Path, keep: int = 2, state_name: str = STATE, rank: int = 0) -> None:
        self.root = str(root)
        self.staging = Path(staging)
        self.keep = keep
        self.state_name = state_name
        self.rank = rank  # a process of several fetches into a directory of its own

    def complete(self) -> list[tuple[int, str]]:
        """(step, uri) of every complete checkpoint, oldest first."""
        found = set()
        for uri in storage.list_uris(self.root):
            parent, _, name = uri.rstrip("/").rpartition("/")
            m = _STEP.search(parent)
            if name == storage.MANIFEST and m:
                found.add((int(m.group(1)), parent))
        # a manifest whose files are not all there (lost after the upload) is no checkpoint: fall back
        return sorted((step, uri) for step, uri in found if storage.is_complete(uri))

    def latest(self) -> tuple[int, str] | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, write: Callable[[Path], None], state: dict[str, Any], main: bool = True,
             barrier: Callable[[], None] = lambda: None) -> str:
        """Stage, write (`write(dir)` + the state), publish atomically, prune the oldest.

        Several processes (accelerate's save_state writes from every rank into one directory): every rank
        calls it with `barrier`; the main one (`main`) prepares the directory, writes the state and publishes.
        The staging directory is then one per node: a multi-node ZeRO checkpoint holds the main node's shards
        only, so it resumes only with a staging directory on a shared volume.
        """
        local = self.staging / step_name(step)
        if main:
            if local.exists():
                shutil.rmtree(local)
            local.mkdir(parents=True)
        barrier()
        local.mkdir(parents=True, exist_ok=True)  # another node's own staging directory
        write(local)
        barrier()
        uri = storage.join(self.root, step_name(step))
        if main:
            (local / self.state_name).write_text(json.dumps({"step": step, **state}, indent=1, sort_keys=True))
            storage.put_dir(local, uri)
            shutil.rmtree(local, ignore_errors=True)
            for _, old in self.complete()[: -self.keep]:
                storage.delete(old)
        barrier()
        return uri

    def fetch(self, uri: str) -> tuple[Path, dict[str, Any]]:
        """A local copy of a complete checkpoint (verified against its manifest) and its trainer state."""
        if storage.is_s3(uri):
            local = storage.get_dir(uri, self.staging / (f"fetched-r{self.rank}-" + uri.rstrip("/").rpartition("/")[2]))
        else:
            storage.read_manifest(uri)  # refuses an incomplete directory
            local = Path(uri)
        return local, json.loads((local / self.state_name).read_text())

    # -- stages: a phase's intermediate results (rejection sampling's kept set, DPO's A/B logs) -----------
    def put_stage(self, name: str, local_dir: str | Path) -> str:
        """Publish a finished stage's directory (manifest last): a retry reuses it instead of redoing it."""
        uri = storage.join(self.root, name)
        storage.put_dir(local_dir, uri)
        return uri

    def stage(self, name: str) -> Path | None:
        """A local copy of a stage published by an earlier attempt; None if none finished."""
        uri = storage.join(self.root, name)
        if not storage.is_complete(uri):
            return None
        return storage.get_dir(uri, self.staging / ("stage-" + name)) if storage.is_s3(uri) else Path(uri)


class TrainerCheckpoints:
    """Resume for the phases trained by a Hugging Face Trainer (SFT, rejection sampling's SFT, DPO).

    The Trainer saves `checkpoint-N` (weights or adapter, optimizer, scheduler, RNG states, trainer state)
    every `every` steps into its output directory; the callback publishes each one through `Checkpoints`
    with the phase's own state (MLflow run id, wall-clock seconds spent). A retried step fetches the newest
    complete one and passes it to `trainer.train(resume_from_checkpoint=...)`. Under DeepSpeed across nodes
    the Trainer writes each node's shards to that node's output directory: only rank 0's are published, so
    multi-node ZeRO runs resume only with a shared output directory (one node, or a shared volume).
    """

    def __init__(self, root: str, staging: str | Path, every: int | None, keep: int = 2, resume: bool = True) -> None:
        self.store = Checkpoints(root, staging, keep=keep, state_name=HF_STATE)
        self.every = every
        self.resume = resume
        latest = self.store.latest() if resume else None
        self.step = latest[0] if latest else 0
        self.local, self.state = self.store.fetch(latest[1]) if latest else (None, {})

    @property
    def root(self) -> str:
        return self.store.root

    def trainer_args(self) -> dict[str, Any]:
        """Keyword arguments for `TrainingArguments` (checkpoints every `every` steps, or none)."""
        if not self.every:
            return {"save_strategy": "no"}
        return {"save_strategy": "steps", "save_steps": self.every, "save_total_limit": self.store.keep}

    def resume_from(self) -> str | None:
        return str(self.local) if self.local is not None else None

    @property
    def finished(self) -> bool:
        """The checkpoint holds the end of training (a retry after the training, e.g. during the evaluation)."""
        return self.local is not None and bool(self.state.get("finished"))

    def load_finished(self, trainer: Any) -> dict[str, float]:
        """Load a finished checkpoint's weights into `trainer.model` instead of training: the Trainer, resumed
        at its last step, would run one step more. Returns the stats `train()` would have given."""
        # HF's own loader (full, sharded or PEFT adapter checkpoints); there is no public equivalent
        trainer._load_from_checkpoint(str(self.local))
        hf = json.loads((self.local / "trainer_state.json").read_text())
        losses = [e["loss"] for e in hf.get("log_history", []) if "loss" in e]
        return {"train_loss": sum(losses) / len(losses) if losses else float("nan"),
                "global_step": float(hf["global_step"])}

    def callback(self, state: Callable[[], dict[str, Any]]):
        """A TrainerCallback that publishes every checkpoint the Trainer saves, with `state()` beside it, and
        saves one more at the end of training (marked finished) when the last step was not a multiple."""
        from transformers import TrainerCallback

        store = self.store

        class Publish(TrainerCallback):
            finished = False

            def on_step_end(self, args, tstate, control, **kw):
                # the callbacks before this one (HF's flow, the wall-clock budget) have decided by now
                if control.should_training_stop or tstate.global_step >= tstate.max_steps:
                    self.finished = control.should_save = True

            def on_save(self, args, tstate, control, **kw):
                if not tstate.is_world_process_zero:
                    return
                src = Path(args.output_dir) / f"checkpoint-{tstate.global_step}"
                if src.is_dir():  # copied: the Trainer prunes its own output directory by save_total_limit
                    store.save(tstate.global_step, lambda d: shutil.copytree(src, d, dirs_exist_ok=True),
                               {**state(), "finished": self.finished})

        return Publish()


def train_or_resume(trainer: Any, checkpoints: TrainerCheckpoints | None) -> tuple[float, float, int]:
    """`trainer.train()`, resumed from the newest checkpoint when there is one: (train loss, steps, resumed from).
    A finished checkpoint is loaded instead of trained (a finished ZeRO one resumes through the Trainer: one
    step more than planned)."""
    resumed = checkpoints is not None and checkpoints.resume_from() is not None
    if resumed and checkpoints.finished and not trainer.is_deepspeed_enabled:
        done = checkpoints.load_finished(trainer)  # an earlier attempt finished training: nothing to train
        return done["train_loss"], done["global_step"], checkpoints.step
    out = trainer.train(resume_from_checkpoint=checkpoints.resume_from() if checkpoints else None)
    return out.training_loss, out.global_step, checkpoints.step if resumed else 0
