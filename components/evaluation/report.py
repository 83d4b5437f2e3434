"""The evaluation report: per-suite bars with confidence intervals, per-level curves, deltas, the gate's
decision and example trajectories — one self-contained HTML file."""

from __future__ import annotations

from typing import Any

from components.core.reporting import Report, bar_chart
from components.evaluation.gate import Decision

HEADLINE = ("tgc", "sgc", "pass_at_k", "valid_action_rate", "safety_violation_rate", "avg_steps", "tokens_per_task",
            "skill_reuse_rate")


def _level_figure(cand: dict[str, Any], base: dict[str, Any] | None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name, res, style in (("candidate", cand, "-o"), ("baseline", base, "--s")):
        if not res:
            continue
        levels: dict[int, list[float]] = {}
        for by in res["levels"].values():
            for lv, v in by.items():
                levels.setdefault(int(lv), []).append(v)
        xs = sorted(levels)
        ax.plot(xs, [sum(levels[x]) / len(levels[x]) for x in xs], style, label=name)
    ax.set_xlabel("level")
    ax.set_ylabel("TGC")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Task goal completion per level")
    ax.legend(fontsize=8)
    return fig


PROGRESS_METRICS = ("tgc", "valid_action_rate", "safety_violation_rate")


def phase_progress(runs: list[tuple[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Held-out numbers each phase logged, by phase in run order: {'sft': {'easy/tgc': .1}, 'grpo': {...}}.

    A phase's own held-out keys are `<phase>/<suite>/<metric>`, or under `final/` / `heldout/` (GRPO);
    `incoming/...` keys (what the phase started from) are left out.
    """
    out: dict[str, dict[str, float]] = {}
    for phase, metrics in runs:
        row = {}
        for key, value in metrics.items():
            rest = key.split("/", 1)[1] if key.startswith(f"{phase}/") else None
            if rest is None or rest.startswith("incoming/"):
                continue
            rest = rest.removeprefix("final/").removeprefix("heldout/")
            parts = rest.split("/")
            if len(parts) == 2 and parts[1] in PROGRESS_METRICS:  # any environment's suite names
                row[rest] = float(value)
        if row:
            out[phase] = row
    return out


def render_report(cand: dict[str, Any], base: dict[str, Any] | None, decision: Decision, baseline_name: str | None,
                  deltas: dict[str, float], progress: dict[str, dict[str, float]] | None = None,
                  skipped: dict[str, str] | None = None) -> str:
    rep = Report("agentrl evaluation")
    rep.heading("Gate decision")
    rep.text(("PROMOTE to champion" if decision.promote else "challenger only (not promoted)") +
             (f" — baseline: {baseline_name}" if baseline_name else " — no baseline"))
    rep.table(["reason"], [[r] for r in decision.reasons])
    if skipped:
        rep.heading("Phases skipped in this pipeline run")
        rep.table(["phase", "switched off by"], [[phase, why] for phase, why in skipped.items()])
    suites = list(cand["metrics"])
    for metric in ("tgc", "safety_violation_rate", "valid_action_rate"):
        series = {"candidate": [cand["metrics"][s][metric]["value"] for s in suites]}
        errors = {"candidate": [tuple(cand["metrics"][s][metric]["ci"]) for s in suites]}
        if base:
            series["baseline"] = [base["metrics"][s][metric]["value"] for s in suites]
            errors["baseline"] = [tuple(base["metrics"][s][metric]["ci"]) for s in suites]
        rep.figure(bar_chart(suites, series, metric, f"{metric} per suite (95% CI)", errors), metric)
    rep.figure(_level_figure(cand, base), "TGC per level")
    rep.heading("TGC per level, per suite (candidate [baseline])")
    levels = sorted({int(lv) for by in cand["levels"].values() for lv in by})
    rows = []
    for s in suites:
        by = {int(k): v for k, v in cand["levels"].get(s, {}).items()}
        base_by = {int(k): v for k, v in ((base or {}).get("levels") or {}).get(s, {}).items()}
        rows.append([s, *[(f"{by[lv]:.3f}" + (f" [{base_by[lv]:.3f}]" if lv in base_by else "")) if lv in by else ""
                          for lv in levels]])
    rep.table(["suite", *[f"L{lv}" for lv in levels]], rows)
    if progress:
        rep.heading("Learning from phase to phase (held-out, as each phase measured it)")
        phases = list(progress)
        suites_seen = sorted({k.split("/")[0] for row in progress.values() for k in row if k.endswith("/tgc")})
        rep.figure(bar_chart(phases, {s: [progress[p].get(f"{s}/tgc", 0.0) for p in phases] for s in suites_seen},
                             "tgc", "held-out TGC after each phase (missing = not measured, drawn as 0)"),
                   "TGC per phase")
        keys = sorted({k for row in progress.values() for k in row})
        rep.table(["phase", *keys], [[p, *[progress[p].get(k, "") for k in keys]] for p in phases])
    rep.heading("Metrics (value [CI])")
    rows = []
    for s in suites:
        for m in HEADLINE:
            if m in cand["metrics"][s]:
                v = cand["metrics"][s][m]
                b = base["metrics"][s][m]["value"] if base and m in base["metrics"].get(s, {}) else ""
                rows.append([s, m, v["value"], f"[{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]", b,
                             deltas.get(f"{s}/{m}", "")])
    rep.table(["suite", "metric", "candidate", "CI", "baseline", "delta"], rows)
    rep.heading("Example trajectories (candidate, greedy)")
    for s in suites:
        trajs = cand["trajectories"][s]
        ok = next((t for t in trajs if t.verdict.success), None)
        bad = next((t for t in trajs if not t.verdict.success), None)
        for label, t in (("solved", ok), ("failed", bad)):
            if t is not None:
                rep.heading(f"{s}: {label} — {t.task_id}", level=3)
                rep.pre("\n".join(f"[{x.role}] {x.text}" for x in t.turns[1:12]))
    return rep.render()
