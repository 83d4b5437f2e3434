"""Checkpoints that a preempted pod can trust: `<root>/step-00000042/`, complete only once its manifest is.

A checkpoint holds what `accelerate` saves (weights or adapter, optimizer, scheduler, RNG states; the
ZeRO shards under DeepSpeed) plus `trainer_state.json` (step, curriculum, monitor, skill library,
MLflow run id, best evaluation). It is written to a local staging directory and then published with
`storage.put_dir`, which writes the manifest last (a rename locally, the last object on S3). On start,
the newest step with a manifest wins; a half-written one is ignored, never loaded.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.core import storage

STATE = "trainer_state.json"
_STEP = re.compile(r"step-(\d{8})$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


class Checkpoints:
    def __init__(self, root: str, staging: str | Path, keep: int = 2) -> None:
        self.root = str(root)
        self.staging = Path(staging)
        self.keep = keep

    def complete(self) -> list[tuple[int, str]]:
        """(step, uri) of every complete checkpoint, oldest first."""
        found = set()
        for uri in storage.list_uris(self.root):
            parent, _, name = uri.rstrip("/").rpartition("/")
            m = _STEP.search(parent)
            if name == storage.MANIFEST and m:
                found.add((int(m.group(1)), parent))
        return sorted(found)

    def latest(self) -> tuple[int, str] | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, write: Callable[[Path], None], state: dict[str, Any]) -> str:
        """Stage, write (`write(dir)` + the trainer state), publish atomically, prune the oldest."""
        local = self.staging / step_name(step)
        if local.exists():
            shutil.rmtree(local)
        local.mkdir(parents=True)
        write(local)
        (local / STATE).write_text(json.dumps({"step": step, **state}, indent=1, sort_keys=True))
        uri = storage.join(self.root, step_name(step))
        storage.put_dir(local, uri)
        shutil.rmtree(local, ignore_errors=True)
        for _, old in self.complete()[: -self.keep]:
            storage.delete(old)
        return uri

    def fetch(self, uri: str) -> tuple[Path, dict[str, Any]]:
        """A local copy of a complete checkpoint (verified against its manifest) and its trainer state."""
        if storage.is_s3(uri):
            local = storage.get_dir(uri, self.staging / ("fetched-" + uri.rstrip("/").rpartition("/")[2]))
        else:
            storage.read_manifest(uri)  # refuses an incomplete directory
            local = Path(uri)
        return local, json.loads((local / STATE).read_text())
