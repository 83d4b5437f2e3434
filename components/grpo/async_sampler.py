"""Asynchronous GRPO's sampler: a rollout thread that generates step k's batch with the policy of step k - s while
the trainer updates (bounded staleness s = `grpo.async.max_staleness`).

Written by hand: the peers' async trainers (verl, AReaL, NeMo-RL) are Ray/cluster systems; this is the same
schedule in one process — a thread with its own copy of the weights (CPU: generation and training on one core each;
GPU: the vLLM engine as the sampler). The lag is fixed, not "whatever is newest": batch k is always sampled by
exactly version max(0, k - s) (the weights after that many updates), so a run is deterministic whatever the timing,
and a checkpoint after step k that also holds the batches of steps k .. k+s-1 (already sampled, by versions < k)
resumes exactly. The loss corrects for the lag with importance weights (`loss.importance_weights`).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

from components.core.schema import Trajectory

__all__ = ["AsyncSampler"]


class AsyncSampler:
    """`produce(step, backend, context)` rolls out step `step`'s batch on `backend`, where `context` is what the
    trainer published with the sampling version (the curriculum's state); `backend_for(model)` builds the sampler's
    backend on its private copy of the learner. `pending`: batches restored from a checkpoint, by step."""

    def __init__(self, learner: Any, backend_for: Callable[[Any], Any],
                 produce: Callable[[int, Any, Any], list[Trajectory]], start: int, steps: int, staleness: int,
                 context: Any = None, pending: dict[int, list[Trajectory]] | None = None,
                 threads: int | None = None) -> None:
        if staleness < 1:
            raise ValueError("AsyncSampler needs a staleness >= 1 (0 is the synchronous loop)")
        self.s, self.start, self.steps = staleness, start, steps
        self.model = copy.deepcopy(learner).eval()
        self.model.requires_grad_(False)
        self.backend = backend_for(self.model)
        self._produce = produce
        self._threads = threads
        self._versions: dict[int, tuple[dict[str, Any], Any]] = {}  # published (trainable weights, context)
        self._version = start  # the copy holds the learner's weights as of `start` updates
        self._context = copy.deepcopy(context)
        self._batches: dict[int, list[Trajectory]] = dict(pending or {})
        self._cv = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self.waited_s = 0.0  # trainer time spent waiting for a batch: what the overlap did not hide
        first = start + len(self._batches)
        self._thread = threading.Thread(target=self._run, args=(first,), name="grpo-sampler", daemon=True)
        self._thread.start()

    def version_for(self, step: int) -> int:
        """The policy version (updates applied) that samples step `step`'s batch."""
        return max(0, step - self.s)

    # -- the trainer's side -------------------------------------------------------------------------------------
    def publish(self, version: int, learner: Any, context: Any = None) -> None:
        """The learner after `version` updates; only its trainable tensors travel (a LoRA adapter, or every weight)."""
        if version + self.s >= self.steps:
            return  # no batch is sampled by this version
        state = {n: p.detach().to("cpu", copy=True) for n, p in learner.named_parameters() if p.requires_grad}
        with self._cv:
            self._versions[version] = (state, copy.deepcopy(context))
            self._cv.notify_all()

    def batch(self, step: int) -> tuple[list[Trajectory], int]:
        """Step `step`'s batch (waits for it) and the version that sampled it."""
        t0 = time.perf_counter()
        with self._cv:
            while step not in self._batches and self._error is None:
                self._cv.wait(timeout=1.0)
            if self._error is not None:
                raise RuntimeError("grpo: the rollout thread failed") from self._error
            out = self._batches.pop(step)
            self._cv.notify_all()
        self.waited_s += time.perf_counter() - t0
        return out, self.version_for(step)

    def pending(self, done: int) -> dict[int, list[Trajectory]]:
        """For a checkpoint after `done` steps: the batches of steps done .. done+s-1 (waits until sampled; they need
        versions < done, all published)."""
        want = [k for k in range(done, min(self.steps, done + self.s))]
        with self._cv:
            while any(k not in self._batches for k in want) and self._error is None:
                self._cv.wait(timeout=1.0)
            if self._error is not None:
                raise RuntimeError("grpo: the rollout thread failed") from self._error
            return {k: self._batches[k] for k in want}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=600)

    # -- the thread --------------------------------------------------------------------------------------------
    def _run(self, first: int) -> None:
        try:
            if self._threads:
                import torch

                torch.set_num_threads(self._threads)
            for step in range(first, self.steps):
                need = self.version_for(step)
                with self._cv:
                    # at most s batches ahead of the trainer, and the exact version for this one
                    while not self._stop and (need != self._version and need not in self._versions):
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        return
                    new = self._versions.pop(need, None) if need != self._version else None
                    for v in [v for v in self._versions if v < need]:
                        del self._versions[v]
                if new is not None:
                    self._load(new[0])
                    self._version, self._context = need, new[1]
                trajs = self._produce(step, self.backend, self._context)
                with self._cv:
                    self._batches[step] = trajs
                    self._cv.notify_all()
        except BaseException as exc:  # surfaced to the trainer by `batch`/`pending`
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _load(self, state: dict[str, Any]) -> None:
        import torch

        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)
        self.backend.sync(self.model)
