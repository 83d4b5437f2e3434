"""The pipeline's exit step: end the MLflow parent run with the pipeline's final state (KFP's exit handler runs it
after every task, whether the pipeline succeeded or failed; before it, a parent run on a cluster stayed RUNNING)."""

from __future__ import annotations

from pathlib import Path

from components.core.config import ConfigError, load_config
from components.core.tracking import finish_pipeline_runs, flush_pending, resolve_tracking_uri


def run(state: str, kfp_run_id: str, preset: str = "", overrides: str = "", experiment: str = "",
        parent_run_id: str = "", error: str = "") -> list[str]:
    try:  # the run's own config; when it was what failed (configure refused it), the platform's defaults
        cfg = load_config(preset=preset or None, overrides_json=overrides or None)
    except ConfigError:
        cfg = load_config()
    home = Path(cfg.run.home).resolve()
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, home)
    flush_pending(home / "metric_buffer", quiet=True)
    ended = finish_pipeline_runs(uri, experiment or cfg.tracking.experiment, kfp_run_id, state, parent_run_id, error)
    print(f"finish_run: KFP run {kfp_run_id or '?'} {state}: MLflow parent run(s) {', '.join(ended) or 'none found'}")
    return ended
