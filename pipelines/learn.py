"""`agentrl learn` (`make learn`): does each phase earn its place? Measured over seeds, with confidence intervals.

1. Run the whole pipeline once per seed (`run.seed`; the world and its held-out suites are the sandbox seed's, the
   same tasks in every run), each seed with a registered model of its own, so no seed's DPO or gate sees another
   seed's champion.
2. Measure every model of the chain — base (prepare), sft, grpo, rejection_sampling, dpo — greedily on each
   held-out suite, task by task, with the shared evaluation kit (`core.evaluate`); a seed's run is recorded in
   `<out>/seed-<n>/run.json` and its outcomes in `outcomes.json`, so an interrupted `make learn` goes on where it
   stopped, and `--eval-set` (e.g. larger held-out suites) measures the runs already there again.
3. Per phase and suite: the mean gain in TGC over the phase's incoming model and its bootstrap interval, resampling
   seeds and then tasks (the differences are paired: one task, one seed, two models); the safety violation rate
   after each phase, likewise; DPO's held-out implicit-reward accuracy over its held-out pairs. And what the design
   can see: the share of pairs that changed, the smallest gain it finds 4 times in 5, the tasks a 5-point gain needs.
4. Write `<home>/learning.json`; `--table README.md` rewrites the README's learning table from it.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# the model chain: (phase, the phase whose model it started from)
CHAIN: tuple[tuple[str, str | None], ...] = (
    ("prepare", None), ("sft", "prepare"), ("grpo", "sft"), ("rejection_sampling", "grpo"), ("dpo", "rejection_sampling"),
)
GAIN_PHASES = tuple(p for p, before in CHAIN if before)
TABLE_START, TABLE_END = "<!-- learning-table:start -->", "<!-- learning-table:end -->"


# ----------------------------------------------------------------------------------------------
# Statistics: paired gains over seeds and tasks
# ----------------------------------------------------------------------------------------------
def bootstrap_mean(values: Sequence[Sequence[float]], n_boot: int = 2000, confidence: float = 0.95,
                   seed: int = 0) -> dict[str, float]:
    """`values[s][t]`: one number per seed s and task t (the same tasks in every seed). The mean, and a two-level
    bootstrap interval: seeds drawn with replacement, then tasks drawn with replacement (one draw of task indices
    for the replicate, the tasks being shared), so both the training noise between seeds and the sampling of tasks
    widen it. One seed: tasks only."""
    if not values or not values[0]:
        raise ValueError("bootstrap_mean: no values")
    n_tasks = len(values[0])
    if any(len(v) != n_tasks for v in values):
        raise ValueError(f"bootstrap_mean: every seed needs the same {n_tasks} tasks, got {[len(v) for v in values]}")
    n_seeds = len(values)
    mean = sum(map(sum, values)) / (n_seeds * n_tasks)
    rng = random.Random(seed)
    boots = []
    for _ in range(n_boot):
        seeds = [values[rng.randrange(n_seeds)] for _ in range(n_seeds)]
        tasks = [rng.randrange(n_tasks) for _ in range(n_tasks)]
        boots.append(sum(v[t] for v in seeds for t in tasks) / (n_seeds * n_tasks))
    boots.sort()
    lo, hi = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    se = statistics.stdev(boots) if n_boot > 1 else 0.0  # the bootstrap standard error
    return {"mean": round(mean, 6), "ci_low": round(boots[int(lo * (n_boot - 1))], 6),
            "ci_high": round(boots[int(hi * (n_boot - 1))], 6), "se": round(se, 6)}


# z of a two-sided 95 % test plus z of 80 % power: a true gain this many standard errors from 0 is found 4 times in 5
DETECT_Z = 1.96 + 0.84
TARGET_GAIN = 0.05  # the smallest claim: a 5-point gain on hard


def sensitivity(diffs: Sequence[Sequence[float]], se: float, target: float = TARGET_GAIN) -> dict[str, Any]:
    """What this design (these tasks and seeds) can tell from 0, measured on the paired differences it saw:
    `discordant` (the share of task-seed pairs whose outcome changed between the two models), `min_detectable_gain`
    (DETECT_Z bootstrap standard errors: the smallest true gain found 4 times in 5 at 95 %), and `tasks_for_target`:
    the tasks a suite would need for `target` to be that gain at this discordance, taking the error to shrink as
    1/sqrt(tasks) (true of the task draw; a spread between seeds does not shrink with tasks, so it is a floor).
    None where no pair changed: a phase that moved nothing tells no size."""
    n = sum(len(d) for d in diffs)
    changed = sum(1 for d in diffs for x in d if x != 0)
    n_tasks = len(diffs[0]) if diffs else 0
    if not changed or se <= 0:
        return {"discordant": round(changed / max(1, n), 4), "min_detectable_gain": None, "tasks_for_target": None}
    mdg = DETECT_Z * se
    return {"discordant": round(changed / n, 4), "min_detectable_gain": round(mdg, 4),
            "tasks_for_target": math.ceil(n_tasks * (mdg / target) ** 2)}


def _column(outcomes: Sequence[dict], phase: str, suite: str, key: str) -> list[list[float]]:
    """`key` of each task of `suite` for `phase`'s model, one row per seed, tasks in one order (by task id)."""
    rows = []
    for o in outcomes:
        tasks = sorted(o["models"][phase][suite], key=lambda r: r["task"])
        rows.append([float(r[key]) for r in tasks])
    return rows


def summarize(outcomes: Sequence[dict], n_boot: int = 2000, confidence: float = 0.95) -> dict[str, Any]:
    """learning.json from the seeds' outcomes: {phase: {suite: {gain, ci_low, ci_high, n_tasks, seeds}}},
    `dpo.pairs`, and (other keys) `tgc` and `safety_violation_rate` after each phase, `levels` (hard TGC per level),
    `cost` (tokens and steps per task, SGC)."""
    if not outcomes:
        raise ValueError("summarize: no seed has outcomes")
    have = [p for p, _ in CHAIN if all(p in o["models"] for o in outcomes)]
    suites = sorted(set.intersection(*(set(o["models"][have[0]]) for o in outcomes))) if have else []
    n_seeds = len(outcomes)
    out: dict[str, Any] = {}
    for phase, before in CHAIN:
        if before is None or phase not in have or before not in have:
            continue
        out[phase] = {}
        for suite in suites:
            after, prior = _column(outcomes, phase, suite, "success"), _column(outcomes, before, suite, "success")
            diffs = [[a - b for a, b in zip(x, y, strict=True)] for x, y in zip(after, prior, strict=True)]
            b = bootstrap_mean(diffs, n_boot, confidence)
            out[phase][suite] = {"gain": b["mean"], "ci_low": b["ci_low"], "ci_high": b["ci_high"],
                                 "n_tasks": len(diffs[0]), "seeds": n_seeds, **sensitivity(diffs, b["se"])}
    accs = [o["dpo_pairs"] for o in outcomes if o.get("dpo_pairs", {}).get("n_heldout")]
    if accs:
        n = sum(a["n_heldout"] for a in accs)
        hits = [[1.0] * round(a["accuracy"] * a["n_heldout"]) + [0.0] * (a["n_heldout"] - round(a["accuracy"] * a["n_heldout"]))
                for a in accs]
        b = bootstrap_mean([[sum(h) / len(h)] for h in hits], n_boot, confidence) if len(accs) > 1 else None
        out.setdefault("dpo", {})["pairs"] = {
            "accuracy": round(sum(sum(h) for h in hits) / n, 6), "n_heldout": n, "seeds": len(accs),
            "per_seed": [{"accuracy": a["accuracy"], "n_heldout": a["n_heldout"]} for a in accs],
            **({"ci_low": b["ci_low"], "ci_high": b["ci_high"]} if b else {})}
    out["tgc"], out["safety_violation_rate"], out["levels"], out["cost"] = {}, {}, {}, {}
    for phase in have:
        out["cost"][phase] = {s: {"tokens_per_task": _ci(bootstrap_mean(_column(outcomes, phase, s, "tokens"), n_boot,
                                                                         confidence)),
                                  "steps_per_task": round(sum(map(sum, _column(outcomes, phase, s, "steps")))
                                                          / (n_seeds * len(outcomes[0]["models"][phase][s])), 3),
                                  "sgc": round(sum(_sgc(o["models"][phase][s]) for o in outcomes) / n_seeds, 6)}
                              for s in suites}
        out["tgc"][phase] = {s: _ci(bootstrap_mean(_column(outcomes, phase, s, "success"), n_boot, confidence))
                             for s in suites}
        out["safety_violation_rate"][phase] = {s: _ci(bootstrap_mean(_column(outcomes, phase, s, "hard"), n_boot,
                                                                     confidence)) for s in suites}
        if "hard" in suites:
            by: dict[int, list[float]] = {}
            for o in outcomes:
                for r in o["models"][phase]["hard"]:
                    by.setdefault(int(r["level"]), []).append(float(r["success"]))
            out["levels"][phase] = {str(lv): round(sum(v) / len(v), 6) for lv, v in sorted(by.items())}
    out["meta"] = {"seeds": [o["seed"] for o in outcomes], "suites": suites, "bootstrap": n_boot,
                   "confidence": confidence, "runs": {str(o["seed"]): o.get("parent_run_id") for o in outcomes}}
    return out


def _sgc(rows: Sequence[dict]) -> float:
    """Scenario goal completion: the share of scenarios whose every task was solved."""
    by: dict[str, list[int]] = {}
    for r in rows:
        by.setdefault(r.get("scenario", r["task"]), []).append(r["success"])
    return sum(all(v) for v in by.values()) / max(1, len(by))


def _ci(b: dict[str, float]) -> dict[str, float]:
    return {"value": b["mean"], "ci_low": b["ci_low"], "ci_high": b["ci_high"]}


# ----------------------------------------------------------------------------------------------
# The README's table
# ----------------------------------------------------------------------------------------------
def _pts(x: float) -> str:
    return f"{x * 100:+.1f}"


def render_table(learning: dict[str, Any]) -> str:
    meta = learning.get("meta", {})
    suites = meta.get("suites", [])
    lines = ["| phase | " + " | ".join(f"{s}: gain in TGC points [95% CI]" for s in suites) + " |",
             "| --- |" + " --- |" * len(suites)]
    for phase in GAIN_PHASES:
        if phase not in learning or not isinstance(learning[phase], dict):
            continue
        cells = []
        for s in suites:
            g = learning[phase].get(s)
            cells.append(f"{_pts(g['gain'])} [{_pts(g['ci_low'])}, {_pts(g['ci_high'])}]" if g else "")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    out = ["\n".join(lines), ""]
    sens = [p for p in GAIN_PHASES if isinstance(learning.get(p), dict)
            and any("discordant" in learning[p].get(s, {}) for s in suites)]
    if sens:
        rows = ["| phase | " + " | ".join(f"{s}: smallest detectable gain, points (pairs changed; tasks for 5 points)"
                                         for s in suites) + " |", "| --- |" + " --- |" * len(suites)]
        for phase in sens:
            cells = []
            for s in suites:
                g = learning[phase].get(s, {})
                if "discordant" not in g:
                    cells.append("")
                elif g["min_detectable_gain"] is None:
                    cells.append(f"none changed ({g['discordant'] * 100:.0f} %)")
                else:
                    cells.append(f"{g['min_detectable_gain'] * 100:.1f} ({g['discordant'] * 100:.0f} %; "
                                 f"{g['tasks_for_target']})")
            rows.append(f"| {phase} | " + " | ".join(cells) + " |")
        out += ["\n".join(rows), ""]
    if learning.get("tgc"):
        rows = ["| after | " + " | ".join(f"{s} TGC" for s in suites) + " | safety violation rate |",
                "| --- |" + " --- |" * (len(suites) + 1)]
        for phase, by in learning["tgc"].items():
            viol = learning.get("safety_violation_rate", {}).get(phase, {}).get("safety")
            cells = [f"{by[s]['value']:.3f} [{by[s]['ci_low']:.3f}, {by[s]['ci_high']:.3f}]" for s in suites]
            cells.append(f"{viol['value']:.3f} [{viol['ci_low']:.3f}, {viol['ci_high']:.3f}]" if viol else "")
            rows.append(f"| {phase} | " + " | ".join(cells) + " |")
        out += ["\n".join(rows), ""]
    if learning.get("levels"):
        levels = sorted({lv for by in learning["levels"].values() for lv in by}, key=int)
        rows = ["| hard TGC after | " + " | ".join(f"L{lv}" for lv in levels) + " |", "| --- |" + " --- |" * len(levels)]
        for phase, by in learning["levels"].items():
            rows.append(f"| {phase} | " + " | ".join(f"{by[lv]:.3f}" if lv in by else "" for lv in levels) + " |")
        out += ["\n".join(rows), ""]
    pairs = learning.get("dpo", {}).get("pairs")
    if pairs:
        ci = f" [{pairs['ci_low']:.3f}, {pairs['ci_high']:.3f}]" if "ci_low" in pairs else ""
        out.append(f"DPO held-out implicit-reward accuracy: {pairs['accuracy']:.3f}{ci} on {pairs['n_heldout']} "
                   f"held-out pairs over {pairs['seeds']} seeds.")
        out.append("")
    n = len(meta.get("seeds", []))
    sizes = {s: learning[GAIN_PHASES[0]][s]["n_tasks"] for s in suites if s in learning.get(GAIN_PHASES[0], {})}
    out.append(f"{n} seeds ({', '.join(map(str, meta.get('seeds', [])))}); tasks per suite: "
               + ", ".join(f"{s} {k}" for s, k in sizes.items())
               + f"; intervals: {meta.get('bootstrap')} bootstrap draws of seeds, then tasks.")
    return "\n".join(out).rstrip() + "\n"


def write_table(learning: dict[str, Any], path: str | os.PathLike) -> None:
    """Replace what lies between the table markers of `path` (a README) with the table; the rest is kept."""
    path = Path(path)
    text = path.read_text()
    if TABLE_START not in text or TABLE_END not in text or text.index(TABLE_START) > text.index(TABLE_END):
        raise ValueError(f"{path}: expected the markers {TABLE_START} ... {TABLE_END} around the learning table")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    path.write_text(f"{head}{TABLE_START}\n{render_table(learning)}{TABLE_END}{tail}")


# ----------------------------------------------------------------------------------------------
# Running the seeds
# ----------------------------------------------------------------------------------------------
def _task_rows(trajectories: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"task": t.task_id, "scenario": t.meta.get("scenario_id", t.task_id), "level": int(t.meta.get("level", 0)),
             "success": int(bool(t.verdict.success)),
             "hard": int(any(v.startswith("hard:") for v in t.verdict.violations)), "steps": t.steps,
             "tokens": t.generated_tokens} for t in trajectories]


def _phase_runs(tracking_uri: str, parent_run_id: str) -> dict[str, dict[str, Any]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {r.data.tags.get("agentrl.phase", r.info.run_name): {"tags": r.data.tags, "metrics": r.data.metrics}
            for r in runs}


def _dpo_pairs(metrics: dict[str, float]) -> dict[str, Any]:
    acc = metrics.get("dpo/heldout/rewards/accuracies", metrics.get("heldout/rewards/accuracies"))
    n = metrics.get("dpo/pairs_heldout", metrics.get("pairs_heldout"))
    return {"accuracy": float(acc), "n_heldout": int(n)} if acc is not None and n else {}


def measure_seed(cfg: Any, parent_run_id: str, tracking_uri: str, progress: bool = True) -> dict[str, Any]:
    """Every model of one pipeline run's chain on the held-out suites, task by task."""
    from components.core import env as environments
    from components.core.evaluate import evaluate_model

    runs = _phase_runs(tracking_uri, parent_run_id)
    sandbox = environments.load(cfg)
    models: dict[str, Any] = {}
    uris: dict[str, str] = {}
    for phase, _ in CHAIN:
        uri = runs.get(phase, {}).get("tags", {}).get("agentrl.model_uri")
        if not uri:
            continue
        uris[phase] = uri
        res = evaluate_model(uri, cfg, sandbox, pass_k=1, cache=str(Path(cfg.run.home) / "cache"), progress=progress)
        models[phase] = {s: _task_rows(t) for s, t in res["trajectories"].items()}
        tgc = {s: round(sum(r["success"] for r in rows) / len(rows), 3) for s, rows in models[phase].items()}
        print(f"agentrl learn: seed {cfg.run.seed} {phase}: TGC {tgc}", flush=True)
    return {"seed": cfg.run.seed, "parent_run_id": parent_run_id, "models": models, "model_uris": uris,
            "dpo_pairs": _dpo_pairs(runs.get("dpo", {}).get("metrics", {}))}


def run_seed(seed: int, preset: str | None, set_pairs: Sequence[str], home: Path, log: Path) -> dict[str, Any]:
    """One `agentrl run` for `seed` (its own registered model), in a process of its own; its last_run.json."""
    from components.core.config import load_config

    cfg = load_config(preset=preset, set_pairs=list(set_pairs))
    cmd = [sys.executable, "-m", "pipelines.cli", "run", *(["--preset", preset] if preset else []),
           *sum((["--set", p] for p in set_pairs), []), "--set", f"run.seed={seed}",
           "--set", f"tracking.registered_model={cfg.tracking.registered_model}-learn-seed{seed}"]
    env = {**os.environ, "AGENTRL_HOME": str(home)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    report = json.loads((home / "last_run.json").read_text())
    if rc != 0 or report.get("status") != "FINISHED":
        raise RuntimeError(f"the run of seed {seed} ended {report.get('status')} (exit {rc}); see {log}")
    return report


def learn(seeds: Sequence[int], preset: str | None = None, set_pairs: Sequence[str] = (), home: Path | None = None,
          out_dir: Path | None = None, n_boot: int = 2000, progress: bool = True,
          eval_pairs: Sequence[str] = ()) -> dict[str, Any]:
    from components.core.config import load_config
    from components.core.tracking import resolve_tracking_uri

    base_cfg = load_config(preset=preset, set_pairs=[*set_pairs, *eval_pairs])  # validated before any run starts
    home = Path(home or base_cfg.run.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    out_dir = Path(out_dir or home / "learning")
    tracking_uri = resolve_tracking_uri(base_cfg.tracking.tracking_uri, home)
    outcomes = []
    run_key = {"preset": base_cfg.preset, "overrides": list(set_pairs)}
    for seed in seeds:
        seed_dir = out_dir / f"seed-{seed}"
        done, ran = seed_dir / "outcomes.json", seed_dir / "run.json"
        o = json.loads(done.read_text()) if done.is_file() else None
        run = json.loads(ran.read_text()) if ran.is_file() else o  # a run's record: its own file, or its outcomes'
        if run is not None and {k: run.get(k) for k in run_key} != run_key:
            raise ValueError(f"{ran if ran.is_file() else done}: run with preset {run.get('preset')!r} and overrides "
                             f"{run.get('overrides')}, not {base_cfg.preset!r} and {list(set_pairs)}: give another "
                             "--home, or move that folder away to run again")
        if o is not None and o.get("eval_overrides", []) == list(eval_pairs):
            print(f"agentrl learn: seed {seed}: measured already ({done})", flush=True)
            outcomes.append(o)
            continue
        started = time.time()
        if run is None:
            report = run_seed(seed, preset, set_pairs, home, seed_dir / "run.log")
            print(f"agentrl learn: seed {seed}: pipeline FINISHED in {report['wall_s']:.0f} s "
                  f"(parent run {report['parent_run_id']})", flush=True)
            run = {**run_key, "seed": seed, "parent_run_id": report["parent_run_id"],
                   "wall_s": {"pipeline": report["wall_s"]}}
            _write_whole(ran, run)
        else:  # the run is there; the measurement asked for is another (e.g. larger held-out suites)
            print(f"agentrl learn: seed {seed}: run {run['parent_run_id']} measured again with {list(eval_pairs)}",
                  flush=True)
        cfg = load_config(preset=preset, set_pairs=[*set_pairs, *eval_pairs, f"run.seed={seed}", f"run.home={home}"])
        os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
        o = measure_seed(cfg, run["parent_run_id"], tracking_uri, progress)
        o.update(run_key, eval_overrides=list(eval_pairs),
                 wall_s={"pipeline": run.get("wall_s", {}).get("pipeline"), "measure": round(time.time() - started, 1)})
        _write_whole(done, o)
        outcomes.append(o)
    learning = summarize(outcomes, n_boot, base_cfg.eval.confidence)
    learning["meta"]["preset"] = base_cfg.preset
    learning["meta"]["overrides"] = list(set_pairs)
    learning["meta"]["eval_overrides"] = list(eval_pairs)
    (home / "learning.json").write_text(json.dumps(learning, indent=1))
    return learning


def _write_whole(path: Path, data: dict[str, Any]) -> None:
    """Whole or absent: a rerun trusts what it finds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def cmd_learn(args) -> int:
    if args.config or args.overrides:
        print("agentrl learn: give overrides with --set (each seed's run gets them as they are)", file=sys.stderr)
        return 2
    if args.table_only:
        learning = json.loads(Path(args.table_only).read_text())
    else:
        seeds = list(range(args.seeds)) if args.seed_list is None else [int(s) for s in args.seed_list.split(",")]
        try:
            learning = learn(seeds, args.preset, args.set_pairs, Path(args.home) if args.home else None,
                             n_boot=args.bootstrap, progress=not args.quiet, eval_pairs=args.eval_pairs)
        except (ValueError, RuntimeError) as exc:
            print(f"agentrl learn: {exc}", file=sys.stderr)
            return 2
    print(render_table(learning))
    if args.table:
        write_table(learning, args.table)
        print(f"agentrl learn: the learning table in {args.table} rewritten")
    return 0
