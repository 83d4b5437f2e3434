"""Asynchronous GRPO against synchronous on the tiny preset: GRPO steps per minute, and held-out TGC after the same
number of updates, side by side in one run, over three seeds.

Both sides start from the same SFT model (the tiny preset's sandbox, base and SFT, built once and cached under
$AGENTRL_HOME/bench/async-grpo) and run the GRPO phase as the pipeline does, in a process of its own, for a fixed
number of steps (no time budget) with an evaluation only at the end. Sync uses both cores for everything; async
(`grpo.async.max_staleness=1`) gives the rollout thread one core and the trainer the other. Steps per minute come
from the phase's own `step_seconds` (a step's wall time, waiting for its batch included).
`AGENTRL_BENCH_REUSE=1` takes the figures of runs an earlier bench finished instead of running them again."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SEEDS = (0, 1, 2)
STEPS = 10


def _base(home: Path) -> tuple[Path, Path]:
    """(SFT model, sandbox dir) of the tiny preset, built once."""
    from components.prepare.recipe import run as prepare
    from components.sandbox.recipe import run as build_sandbox
    from components.sft.recipe import run as sft

    work = home / "bench" / "async-grpo"
    model, box = work / "sft", work / "sandbox"
    if (model / "agentrl.json").is_file():
        return model, box
    overrides = json.dumps({"run": {"home": str(home)}})
    b = build_sandbox(overrides=overrides, out_dir=str(box))
    base = prepare(overrides=overrides, model_out=str(work / "base"), parent_run_id=b.parent_run_id,
                   corpus=str(box / "corpus.txt"))
    sft(overrides=overrides, base_model=base.model_dir, demos=str(box / "demos"), tasks_dir=str(box / "tasks"),
        parent_run_id=b.parent_run_id, model_out=str(model))
    return model, box


def _grpo(home: Path, model: Path, box: Path, name: str, seed: int, staleness: int) -> dict:
    run_home = home / "bench" / "async-grpo" / "runs" / f"{name}-{seed}"
    if os.environ.get("AGENTRL_BENCH_REUSE") == "1" and (run_home / "out" / "agentrl.json").is_file():
        return _summary(*_grpo_run(run_home))  # a finished run of an earlier bench: its figures again
    ov = {"run": {"home": str(run_home), "seed": seed, "torch_threads": 2 if not staleness else 1},
          "grpo": {"steps": STEPS, "max_minutes": None, "eval_every": 0, "output": "last",
                   "checkpoint_every": STEPS, "checkpoint_uri": str(run_home / "ckpt"),
                   "torch_threads": 2 if not staleness else 1, "async": {"max_staleness": staleness}}}
    args = {"overrides": json.dumps(ov), "policy_model": str(model), "tasks_dir": str(box / "tasks"),
            "model_out": str(run_home / "out")}
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "2" if not staleness else "1"}
    res = subprocess.run([sys.executable, "-m", "components.grpo", "--args", json.dumps(args)], env=env,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"bench async_grpo ({name}, seed {seed}) failed:\n{res.stderr[-3000:]}")
    return _summary(*_grpo_run(run_home))


def _grpo_run(run_home: Path):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_home}/mlflow.db")
    runs = client.search_runs(client.get_experiment_by_name("agentrl").experiment_id, "tags.`agentrl.phase` = 'grpo'")
    return client, runs[0]


def _summary(client, run) -> dict:
    """Steps/min over the whole run, and from the median step (a step with a repair SFT, which alarms trigger on
    either side, costs several plain ones: the median is the scheduling's, the mean the run's)."""
    hist = lambda k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)]  # noqa: E731
    secs = hist("grpo/step_seconds")
    final = run.data.metrics
    return {"steps_per_min": 60 * len(secs) / sum(secs), "median_steps_per_min": 60 / statistics.median(secs),
            "alarms": sum(hist("grpo/alarms")), "easy": final["grpo/final/easy/tgc"], "hard": final["grpo/final/hard/tgc"]}


def bench_async_grpo(out: dict) -> None:
    home = Path(os.environ.get("AGENTRL_HOME", ".agentrl")).resolve()
    model, box = _base(home)
    sides = {name: [_grpo(home, model, box, name, seed, s) for seed in SEEDS] for name, s in (("sync", 0), ("async", 1))}

    def mean(name, key):
        return statistics.fmean(r[key] for r in sides[name])

    def sd(name, key):
        return statistics.stdev(r[key] for r in sides[name])

    sync_rate, async_rate = mean("sync", "steps_per_min"), mean("async", "steps_per_min")
    out["grpo.async_steps_per_min"] = {
        "value": round(async_rate, 2), "unit": "steps/min", "goal": 1.3, "baseline": round(sync_rate, 2),
        "ratio": round(async_rate / sync_rate, 2), "steps": STEPS, "seeds": list(SEEDS), "staleness": 1,
        "per_seed": {n: [round(r["steps_per_min"], 2) for r in rs] for n, rs in sides.items()},
        "alarms": {n: [r["alarms"] for r in rs] for n, rs in sides.items()}}
    med_sync, med_async = mean("sync", "median_steps_per_min"), mean("async", "median_steps_per_min")
    out["grpo.async_median_steps_per_min"] = {
        "value": round(med_async, 2), "unit": "steps/min", "goal": 1.3, "baseline": round(med_sync, 2),
        "ratio": round(med_async / med_sync, 2),
        "per_seed": {n: [round(r["median_steps_per_min"], 2) for r in rs] for n, rs in sides.items()}}
    for suite in ("easy", "hard"):
        out[f"grpo.async_heldout_{suite}_tgc"] = {
            "value": round(mean("async", suite), 3), "unit": "TGC", "goal": None,
            "baseline": round(mean("sync", suite), 3), "ratio": None,
            "sd": {"async": round(sd("async", suite), 3), "sync": round(sd("sync", suite), 3)},
            "per_seed": {n: [r[suite] for r in rs] for n, rs in sides.items()}}
