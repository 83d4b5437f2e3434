"""The scaffold every phase's recipe is built on: what a phase does before and after its own work.

    ctx = PhaseContext.setup(PHASE, preset, overrides, ...)       # config parsed and validated once, before any work
    ckpts = ctx.trainer_checkpoints(cfg.sft)                      # where a KFP retry of this step finds them
    with ctx.open(resume=ckpts.state) as tracker:                 # the phase's MLflow run (the same one when resumed)
        env = ctx.environment()                                   # tasks, suites, episodes (core.env)
        policy = ctx.load_policy(incoming)                        # dtype, cache, LoRA as configured
        ...                                                       # the phase's own steps
        return ctx.finish(out, card, metrics)                     # stored under the run, one PhaseResult

`launch` is the dispatcher the KFP components call: the phase in this process, under torchrun over the pod's GPUs,
or as a multi-node TrainJob.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

from components.core.config import MultiNodeConfig, PipelineConfig, load_config

__all__ = ["PhaseContext", "PhaseResult", "Places", "launch", "main", "setup_phase"]


class Places(TypedDict, total=False):
    """Where a phase's inputs and outputs are, the same keywords for every phase's `run`: the sandbox_build outputs
    (`world`, `tasks_dir`; empty: generated from the config), the pipeline's MLflow run (`parent_run_id`), the model
    directory to write (`model_out`, the KFP output path) and the work directory (`work_dir`, shared by the processes
    of a torchrun launch)."""

    world: str
    tasks_dir: str
    parent_run_id: str | None
    model_out: str | None
    work_dir: str | None


def setup_phase(preset: str = "", overrides: str = "", set_pairs=(), torch_threads: bool = True):
    """What every phase does first: resolve and validate the config (before any work), pin AGENTRL_HOME,
    set the torch thread count. Returns (config, home, storage root)."""
    cfg = load_config(preset=preset or None, overrides_json=overrides or None, set_pairs=set_pairs)
    home = Path(cfg.run.home).resolve()
    os.environ.setdefault("AGENTRL_HOME", str(home))
    if torch_threads:
        from components.core.tiny import set_torch_threads

        set_torch_threads(cfg.run.torch_threads)
    return cfg, home, cfg.storage.root or str(home / "store")


@dataclass
class PhaseResult:
    """What a training phase hands on: its runs, the model (local directory and stored URI) and its metrics."""

    parent_run_id: str
    run_id: str
    model_dir: str
    model_uri: str
    metrics: dict[str, float] = field(default_factory=dict)
    steps_done: int = 0
    resumed_from: int | None = None

    def publish(self, metrics: Any, model: Any, **metadata: Any) -> None:
        """Hand the result to KFP: every metric to the step's Metrics artifact (the UI's names: '/' -> '_'), the
        stored model's URI and `metadata` on its Model artifact."""
        for name, value in sorted(self.metrics.items()):
            metrics.log_metric(name.replace("/", "_"), float(value))
        model.metadata.update({"uri": self.model_uri, **metadata})


@dataclass
class PhaseContext:
    """One phase's run: its config (parsed once), places, tracker, environment and incoming model."""

    phase: str
    cfg: PipelineConfig
    home: Path
    storage_root: str
    parent_run_id: str | None = None
    world: str | None = None
    tasks_dir: str | None = None
    work_dir: str | None = None
    model_out: str | None = None
    tracker: Any = None
    work: Path | None = None
    _env: Any = None

    @classmethod
    def setup(cls, phase: str, preset: str = "", overrides: str = "", *, incoming: str | None = None,
              incoming_name: str = "policy_model", **places: Unpack[Places]) -> PhaseContext:
        """Validate the config and the inputs before any work. `incoming`: the model the phase starts from, required
        when given as an argument (an empty string is the error a wiring mistake makes). `places`: parent_run_id, world,
        tasks_dir, work_dir, model_out."""
        cfg, home, storage_root = setup_phase(preset, overrides)
        if incoming is not None and not incoming:
            raise ValueError(f"{phase}: no incoming policy ({incoming_name}) to start from")
        unknown = set(places) - set(Places.__annotations__)
        if unknown:
            raise TypeError(f"{phase}: unknown keyword(s) {sorted(unknown)}; a phase's places are {list(Places.__annotations__)}")
        return cls(phase, cfg, home, storage_root, **{k: (v or None) for k, v in places.items()})

    def use_threads(self, n: int | None) -> None:
        """The phase's own torch thread count on CPU (its config's `torch_threads`; 0/None: the run's)."""
        if n and self.cfg.run.torch_device() != "cuda":
            from components.core.tiny import set_torch_threads

            set_torch_threads(n)

    # ------------------------------------------------------------------------------------------
    # Before: checkpoints, the run, the work directory
    # ------------------------------------------------------------------------------------------
    def checkpoint_root(self, uri: str | None = None) -> str:
        """Where this phase's checkpoints live: under the parent run, so a KFP retry of the step finds them."""
        from components.core.checkpoint import phase_root

        return phase_root(self.storage_root, self.parent_run_id, self.phase, uri)

    def staging(self, *parts: str) -> Path:
        return self.home / "staging" / self.phase / (self.parent_run_id or "standalone") / Path(*parts)

    def trainer_checkpoints(self, every: int, keep: int, resume: bool, uri: str | None = None, per_rank: bool = False):
        """Checkpoints of a Hugging Face Trainer, published to storage as it saves them."""
        from components.core.checkpoint import TrainerCheckpoints
        from components.core.tracking import rank

        staging = self.staging(f"rank{rank()}") if per_rank else self.staging()
        return TrainerCheckpoints(self.checkpoint_root(uri), staging, every, keep, resume)

    @contextlib.contextmanager
    def open(self, resume: dict[str, Any] | None = None) -> Iterator[Any]:
        """The phase's MLflow run under the pipeline's parent run; `resume`: the state a checkpoint saved (its run and
        parent run are continued). Sets `tracker` and the work directory (given, or under <home>/runs)."""
        from components.core.tracking import phase_run

        resume = resume or {}
        with phase_run(self.phase, config=self.cfg, parent_run_id=self.parent_run_id or resume.get("parent_run_id")
                       or None, close_parent=False, resume_run_id=resume.get("run_id")) as tracker:
            self.tracker = tracker
            self.work = Path(self.work_dir or self.home / "runs" / tracker.run_id / self.phase)
            self.work.mkdir(parents=True, exist_ok=True)
            yield tracker

    @property
    def out(self) -> Path:
        """Where the phase writes its model: the step's output path, or the work directory."""
        assert self.work is not None, "open() the phase first"
        return Path(self.model_out) if self.model_out else self.work / "model"

    # ------------------------------------------------------------------------------------------
    # The environment and the models
    # ------------------------------------------------------------------------------------------
    def environment(self):
        """The environment with its tasks (core.env), loaded once."""
        if self._env is None:
            from components.core.env import load

            self._env = load(self.cfg, self.world, self.tasks_dir)
        return self._env

    def load_policy(self, uri: str, trainable: bool = True, lora: bool = True, base_model: bool = False,
                    bf16: bool | None = None):
        """A policy to train: bf16 or float32 (`bf16`, default `sft.bf16`), the model cache, a LoRA adapter when
        `model.lora` is on. `base_model`: a base, loaded with `model.*` (tiny architecture, chat template)."""
        from components.core.policy import load_policy, trainable_lora

        bf16 = self.cfg.sft.bf16 if bf16 is None else bf16
        policy = load_policy(uri, dtype="bfloat16" if bf16 else "float32", trainable=trainable,
                             cache=self.home / "cache", **({"model_cfg": self.cfg.model} if base_model else {}))
        if lora and trainable and self.cfg.model.lora.enabled:
            policy = trainable_lora(policy, self.cfg.model.lora)
        return policy

    def card(self, base_model: str, **extra: Any):
        from components.core.schema import ModelCard

        return ModelCard(base_model=base_model, phase=self.phase, parent_run_id=self.tracker.parent_run_id,
                         run_id=self.tracker.run_id, extra=extra)

    # ------------------------------------------------------------------------------------------
    # After: measure, store, hand on
    # ------------------------------------------------------------------------------------------
    def quick_eval(self, model_dir: str, suites: Sequence[str]) -> dict[str, float]:
        """Greedy held-out metrics of a model on `suites` (core.evaluate)."""
        from components.core.evaluate import quick_eval

        return quick_eval(model_dir, self.cfg, self.tasks_dir, suites, self.world)

    def before_after(self, incoming: str, outgoing: str | None, suites: Sequence[str]) -> dict[str, float]:
        """The incoming model's held-out metrics as `incoming/<suite>/<metric>` and the outgoing one's as
        `<suite>/<metric>`; `outgoing` None: the incoming weights passed through, the same greedy numbers."""
        before = self.quick_eval(incoming, suites)
        after = self.quick_eval(outgoing, suites) if outgoing else dict(before)
        return {**{f"incoming/{k}": v for k, v in before.items()}, **after}

    def finish(self, out: Path, card: Any, metrics: dict[str, float], stored: dict[str, Path] | None = None,
               steps_done: int = 0, resumed_from: int | None = None) -> PhaseResult:
        """Store the model (with its card) and `stored` directories under the run's prefix; the phase's result."""
        from components.core import storage

        uri = self.tracker.store_model(out, self.storage_root, card)
        for name, local in (stored or {}).items():
            storage.put_dir(local, self.tracker.storage_uri(self.storage_root, name))
        return PhaseResult(self.tracker.parent_run_id, self.tracker.run_id, str(out), uri, metrics, steps_done,
                           resumed_from)


# ----------------------------------------------------------------------------------------------
# Launching a phase: this process, torchrun over the pod's GPUs, or a multi-node TrainJob
# ----------------------------------------------------------------------------------------------
def launch(module: str, run: Callable[..., PhaseResult], kwargs: dict[str, Any], multi_node: MultiNodeConfig,
           processes: int, staged_dirs: tuple[str, ...] = (), staged_files: dict[str, str] | None = None,
           storage_root: str | None = None) -> PhaseResult:
    """Run a phase the way its config asks: `multi_node.enabled` -> a TrainJob/PyTorchJob over several nodes, awaited
    here (its local inputs `staged_dirs`/`staged_files` are staged to storage first); `processes` > 1 -> one process
    per GPU under torchrun, sharing one work directory; else `run(**kwargs)` in this process."""
    from components.core.launch import run_as_job, run_torchrun

    if multi_node.enabled:
        return PhaseResult(**run_as_job(module, module.rsplit(".", 1)[-1], multi_node, storage_root, kwargs,
                                        staged_dirs, staged_files or {}))
    if processes > 1:
        return PhaseResult(**run_torchrun(module, processes, kwargs))
    return run(**kwargs)


def main(module: str, run: Callable[..., PhaseResult], argv: list[str] | None = None) -> int:
    """`python -m <module> --args '<json>' [--result PATH]`: a phase as a process of its own (what torchrun and a
    multi-node job start); rank 0 writes the result (a path, or an s3:// URI when a job reports back)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog=f"python -m {module}")
    p.add_argument("--args", required=True, help=f"JSON object of {module}.run keyword arguments")
    p.add_argument("--result", default=None, help="write the result (JSON) here (rank 0)")
    ns = p.parse_args(argv)
    try:
        res = run(**json.loads(ns.args))
    finally:
        leave_process_group()
    if ns.result and res is not None:
        from components.core import storage

        storage.write_text(ns.result, json.dumps(res.__dict__))
    return 0


def leave_process_group() -> None:
    """Destroy the torch.distributed group before the interpreter exits (no collective follows a phase's `run`): left
    to the interpreter's teardown, a rank's gloo/DeepSpeed threads can abort the process ("terminate called without
    an active exception", seen once in a ZeRO-3 run over 2 CPU processes)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
