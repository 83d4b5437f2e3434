"""A phase switched off in the run form: its input model goes on unchanged, and MLflow records the phase as
skipped (a run under the pipeline's parent, tagged `agentrl.skipped`), so `agentrl run`, `agentrl compare` and
the evaluation report list it as such."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from components.core.phase import setup_phase
from components.core.tracking import PhaseRun


@dataclass
class SkipResult:
    parent_run_id: str
    run_id: str


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the same file system (kfp.local, one pod's volumes): no bytes copied
    except OSError:
        shutil.copy2(src, dst)


def pass_through(src: str | Path, dest: str | Path) -> None:
    """Hand the model at `src` on as `dest` (a directory, or a file for single-file models)."""
    src, dest = Path(src), Path(dest)
    if not src.exists():
        raise FileNotFoundError(f"skip: the incoming model {src} does not exist")
    if src.is_dir():
        shutil.copytree(src, dest, dirs_exist_ok=True, copy_function=_link_or_copy)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(str(src), str(dest))


def run(phase: str, switch: str, preset: str = "tiny", overrides: str = "", policy: str = "",
        model_out: str = "", parent_run_id: str | None = None) -> SkipResult:
    """Record `phase` as skipped (because of the run-form parameter `switch`) and pass `policy` on."""
    cfg, _, _ = setup_phase(preset, overrides, torch_threads=False)
    with PhaseRun(phase, config=cfg, parent_run_id=parent_run_id or None, close_parent=False,
                  run_name=f"{phase} (skipped)", tags={"agentrl.skipped": "true", "agentrl.skipped_by": f"{switch}=false"}
                  ) as tracker:
        if model_out:
            pass_through(policy, model_out)
        print(f"{phase}: skipped ({switch}=false); the incoming model goes on unchanged")
        return SkipResult(tracker.parent_run_id, tracker.run_id)
