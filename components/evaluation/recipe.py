"""The evaluation phase, top to bottom.

1. Resolve the config; open the phase run.
2. Load the sandbox (the sandbox_build outputs, or regenerated from the seed).
3. Evaluate the candidate on easy, hard, safety and robustness: greedy on every task, k samples for pass@k.
4. Evaluate the baseline the same way: the registry's `champion` (or any model given).
5. Log `eval/<suite>/<metric>` and the per-suite deltas; write the HTML report.
6. Register the candidate as a model version with the `challenger` alias; the gate decides whether it
   is promoted to `champion` (done here when `promote=True`, or by the pipeline's `promote` step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.core.evaluate import evaluate_model, flat
from components.core.phase import PhaseContext, setup_phase
from components.core.tracking import PhaseRun, Registry
from components.evaluation.gate import Decision, decide, deltas, paired_delta
from components.evaluation.report import PROGRESS_METRICS, phase_progress, render_report

PHASE = "eval"


@dataclass
class EvalResult:
    parent_run_id: str
    run_id: str
    metrics: dict[str, Any]
    baseline: dict[str, Any] | None
    decision: Decision
    version: str | None
    report_path: str
    flat: dict[str, float] = field(default_factory=dict)


def per_level_metrics(levels: dict[str, dict[int, float]]) -> dict[str, float]:
    """`<suite>/tgc_level_<n>`: TGC of each level a suite holds (the hard suite's L3-L5 apart)."""
    return {f"{suite}/tgc_level_{lv}": v for suite, by in levels.items() for lv, v in by.items()}


def champion_dir(registry: Registry, dest: Path) -> tuple[str, str] | None:
    """(local dir, version) of the current champion, downloaded from its model version source."""
    return registry.download("champion", dest)


def run(
    preset: str = "tiny",
    overrides: str = "",
    model: str = "",
    world: str = "",
    tasks_dir: str = "",
    parent_run_id: str | None = None,
    promote: bool = True,
    report_out: str | None = None,
    suites: tuple[str, ...] = (),
) -> EvalResult:
    ctx = PhaseContext.setup(PHASE, preset, overrides, parent_run_id=parent_run_id, world=world, tasks_dir=tasks_dir)
    cfg, home = ctx.cfg, ctx.home
    if not model:
        raise ValueError("eval: no model to evaluate (model=...)")
    suites = tuple(suites) or tuple(cfg.eval.suites)
    with ctx.open() as tracker:
        registry = Registry(tracker.tracking_uri, cfg.tracking.registered_model)
        sandbox = ctx.environment()
        cand = evaluate_model(model, cfg, sandbox, suites, cache=str(home / "cache"))
        tracker.log_metrics(flat(cand["metrics"]) | per_level_metrics(cand["levels"]), step=0)

        work = ctx.work
        base: dict[str, Any] | None = None
        baseline_name = None
        if cfg.eval.baseline == "champion":
            found = champion_dir(registry, work / "champion")
            if found:
                base = evaluate_model(found[0], cfg, sandbox, suites, cache=str(home / "cache"))
                baseline_name = f"champion (version {found[1]})"
        elif cfg.eval.baseline:
            base = evaluate_model(cfg.eval.baseline, cfg, sandbox, suites, cache=str(home / "cache"))
            baseline_name = cfg.eval.baseline
        d = deltas(cand["metrics"], base["metrics"] if base else None)
        paired = {}
        if base and "hard" in cand["trajectories"] and "hard" in base["trajectories"]:
            paired["hard"] = paired_delta(cand["trajectories"]["hard"], base["trajectories"]["hard"],
                                          cfg.eval.bootstrap_samples, cfg.eval.confidence, cfg.run.seed)
            tracker.log_metrics({"delta/hard/tgc_paired": paired["hard"][0], "delta/hard/tgc_paired_ci_lo":
                                 paired["hard"][1], "delta/hard/tgc_paired_ci_hi": paired["hard"][2]}, step=0)
        if d:
            tracker.log_metrics({f"delta/{k}": v for k, v in d.items()}, step=0)
        decision = decide(cand["metrics"], base["metrics"] if base else None, cfg.eval.gate, paired)
        tracker.set_tags({"agentrl.gate_baseline": baseline_name or "none (no champion yet)"})

        siblings = _sibling_runs(tracker)
        skipped = {phase: why for phase, _, why in siblings if why}
        if skipped:
            tracker.set_tags({"agentrl.skipped_phases": ", ".join(skipped)})
        progress = phase_progress([(phase, m) for phase, m, why in siblings if not why]) | {
            PHASE: {k: v for k, v in flat(cand["metrics"]).items() if k.split("/")[-1] in PROGRESS_METRICS}}
        html = render_report(cand, base, decision, baseline_name, d, progress, skipped)
        report = Path(report_out) if report_out else work / "report.html"
        report.write_text(html)
        (work / "metrics.json").write_text(json.dumps({"candidate": cand["metrics"],
                                                       "baseline": base["metrics"] if base else None,
                                                       "deltas": d, "decision": decision.to_dict()}, indent=1))
        viewable = work / "report.html"  # KFP's output path has no extension; MLflow's viewer renders .html only
        if report.resolve() != viewable.resolve():
            viewable.write_text(html)
        tracker.log_artifact(viewable)
        tracker.log_artifact(work / "metrics.json")
        mv = register_candidate(tracker, registry, model, cand["metrics"], decision, promote)
        return EvalResult(tracker.parent_run_id, tracker.run_id, cand["metrics"], base["metrics"] if base else None,
                          decision, str(mv.version), str(report), flat(cand["metrics"]))


def _sibling_runs(tracker: PhaseRun) -> list[tuple[str, dict[str, float], str | None]]:
    """(phase, latest metrics, why it was skipped or None) of the earlier phase runs under the same pipeline run,
    oldest first."""
    if not tracker.parent_run_id:
        return []
    runs = tracker.client.search_runs([tracker.experiment_id],
                                      filter_string=f"tags.mlflow.parentRunId = '{tracker.parent_run_id}'")
    return [(r.data.tags.get("agentrl.phase", r.info.run_name), dict(r.data.metrics),
             r.data.tags.get("agentrl.skipped_by") if r.data.tags.get("agentrl.skipped") == "true" else None)
            for r in sorted(runs, key=lambda r: r.info.start_time) if r.info.run_id != tracker.run_id]


def register_candidate(tracker: PhaseRun, registry: Registry, model_dir: str, metrics: dict[str, Any],
                       decision: Decision, promote: bool):
    """Log the model to the run in MLflow's transformers flavour (`mlflow.pyfunc.load_model("models:/<name>@champion")`
    serves it), register it as `challenger`; move `champion` when promoted (and allowed)."""
    import tempfile

    from components.core.policy import save_mlflow_model

    with tempfile.TemporaryDirectory(prefix="agentrl-mlflow-model-") as tmp:  # the input model may be read-only
        tracker.log_artifact(save_mlflow_model(model_dir, Path(tmp) / "model"), "model")
    mv = tracker.register_model("model", alias="challenger",
                                tags={"agentrl.promote": str(decision.promote).lower(),
                                      **{f"eval.{k}": str(v) for k, v in flat(metrics).items()
                                         if k.endswith("/tgc") or "violation" in k}})
    if promote and decision.promote:
        registry.set_alias("champion", mv.version)
    tracker.set_tags({"agentrl.gate": "promote" if decision.promote else "challenger",
                      "agentrl.gate_reasons": " | ".join(decision.reasons)[:4900],
                      "agentrl.model_version": str(mv.version)})
    tracker.log_metrics({"gate/promote": float(decision.promote)}, step=0)
    return mv


def fetch_champion(overrides: str, dest: str) -> str:
    """Download the registry's `champion` into `dest` (a model directory); returns its version.
    The start of scheduled retraining; fails clearly when nothing was promoted yet."""
    import shutil
    import tempfile

    cfg, home, _ = setup_phase("", overrides, torch_threads=False)
    from components.core.tracking import resolve_tracking_uri

    registry = Registry(resolve_tracking_uri(cfg.tracking.tracking_uri, home), cfg.tracking.registered_model)
    with tempfile.TemporaryDirectory() as tmp:
        found = champion_dir(registry, Path(tmp))
        if found is None:
            raise RuntimeError(f"registered model {cfg.tracking.registered_model!r} has no 'champion' alias: "
                               "run the full pipeline (agent_rl) until a model passes the gate first")
        local, version = found
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copytree(local, dest, dirs_exist_ok=True)
    return version


def promote_version(version: str, tracking_uri: str | None = None, name: str = "agentrl-policy") -> None:
    """Move the `champion` alias to `version` (the pipeline's promote step, behind the gate)."""
    Registry(tracking_uri, name).set_alias("champion", version)


__all__ = ["EvalResult", "PHASE", "fetch_champion", "promote_version", "register_candidate", "run"]
