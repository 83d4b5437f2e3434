"""One phase again, on what a `make learn` seed's run handed it, with `--set` variants: how the README's DPO variant
table was measured (outside CI; minutes a variant on the tiny preset).

    python -m pipelines.phase_variants dpo --home .agentrl --seed 0 --name rpo --set dpo.sft_weight=1
    AB_LOGS=<simulated.jsonl> python -m pipelines.phase_variants dpo ...   # every variant on the same A/B logs
    python -m pipelines.phase_variants grpo --home .agentrl --name sage-r1 --chain-length 2 \
        --set grpo.sage.enabled=true --set run.seed=1                        # SAGE, GRPO seed 1, chained held-out suites
    python -m pipelines.phase_variants compare --home .agentrl plain-r0,plain-r1 sage-r0,sage-r1
    python -m pipelines.phase_variants compare --home .agentrl @sft,@sft plain-r0,plain-r1   # against the incoming model

`dpo` starts from the seed's rejection-sampling model (variant A and B both), `grpo` from its SFT model,
`rejection_sampling` from its GRPO model (`compare --phase rejection_sampling @grpo <name>`: the gain over it). The phase
runs in this process with the seed run's overrides plus the variant's; its model is then measured greedily on the
easy, hard and safety suites (`--chain-length 2`: as chains of two tasks of one scenario with the skill library
carried, as GRPO's periodic evaluation does for SAGE). One JSON line a variant is appended to
`<home>/phase_variants.jsonl` (TGC, SGC, safety violations, tokens and steps per task, skill reuse, with the
evaluation's bootstrap intervals); its task-by-task outcomes go to `<home>/variants/<phase>-seed<n>-<name>/tasks.json`.
`compare A1,A2,.. B1,B2,..` pairs those outcomes run by run (A1 with B1: the same seed) and task by task: the mean
difference B - A of each measure and its bootstrap interval over runs, then tasks (`pipelines.learn.bootstrap_mean`);
a name `@<phase>` is that model of the learn seed's chain as `agentrl learn` measured it (its outcomes.json; skill
reuse is not recorded there and counts 0), so `@sft` is GRPO's incoming model.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from components.core.config import load_config, parse_set

INCOMING = {"dpo": "rejection_sampling", "grpo": "sft", "rejection_sampling": "grpo"}
KEYS = ("pairs_train", "pairs_heldout", "heldout/rewards/accuracies", "heldout_before/logps/chosen",
        "heldout/logps/chosen", "train_steps", "incoming/safety/safety_violation_rate", "safety/safety_violation_rate",
        "hard_tasks", "kept", "tasks_covered", "probe_success", "sft/train_steps")


MEASURES = ("success", "hard", "tokens", "steps", "skill")


def compare(home: Path, a_names: list[str], b_names: list[str], phase: str = "grpo", seed: int = 0) -> dict:
    """B - A, paired run by run and task by task, for each measure of each suite, with its bootstrap interval; SGC
    (a scenario's tasks all solved) the same over scenarios."""
    from pipelines.learn import _sgc, bootstrap_mean

    if len(a_names) != len(b_names) or not a_names:
        raise ValueError(f"compare: expected as many runs of A as of B (paired by seed), got {a_names} and {b_names}")

    def load(name: str) -> dict[str, list[dict]]:
        if name.startswith("@"):  # a model of the learn seed's own chain, as `agentrl learn` measured it
            path = home / "learning" / f"seed-{seed}" / "outcomes.json"
            if not path.is_file():
                raise FileNotFoundError(f"compare: {path}: not found (`agentrl learn` measures seed {seed} first)")
            models = json.loads(path.read_text())["models"]
            if name[1:] not in models:
                raise ValueError(f"compare: {name}: expected @ and one of {sorted(models)}")
            return {s: [{"skill": 0, **r} for r in rows] for s, rows in models[name[1:]].items()}
        path = home / "variants" / f"{phase}-seed{seed}-{name}" / "tasks.json"
        if not path.is_file():
            raise FileNotFoundError(f"compare: {path}: not found (run the variant {name!r} first)")
        return json.loads(path.read_text())

    runs_a, runs_b = [load(n) for n in a_names], [load(n) for n in b_names]
    out: dict[str, Any] = {"a": a_names, "b": b_names, "suites": {}}
    for suite in sorted(set.intersection(*(set(r) for r in runs_a + runs_b))):
        res: dict[str, Any] = {}
        for key in MEASURES:
            diffs, va, vb = [], [], []
            for ra, rb in zip(runs_a, runs_b, strict=True):
                ta = {r["task"]: float(r[key]) for r in ra[suite]}
                tb = {r["task"]: float(r[key]) for r in rb[suite]}
                tasks = sorted(ta.keys() & tb.keys())
                diffs.append([tb[t] - ta[t] for t in tasks])
                va.append([ta[t] for t in tasks])
                vb.append([tb[t] for t in tasks])
            d = bootstrap_mean(diffs)
            res[key] = {"a": _mean(va), "b": _mean(vb),
                        "diff": round(d["mean"], 4), "ci_low": round(d["ci_low"], 4), "ci_high": round(d["ci_high"], 4)}
        sgc = []
        for ra, rb in zip(runs_a, runs_b, strict=True):
            scen_a = {r["scenario"] for r in ra[suite]} & {r["scenario"] for r in rb[suite]}
            sgc.append([_sgc([r for r in rb[suite] if r["scenario"] == s]) - _sgc([r for r in ra[suite] if r["scenario"] == s])
                        for s in sorted(scen_a)])
        d = bootstrap_mean(sgc)
        res["sgc"] = {"a": round(sum(_sgc(r[suite]) for r in runs_a) / len(runs_a), 4),
                      "b": round(sum(_sgc(r[suite]) for r in runs_b) / len(runs_b), 4),
                      "diff": round(d["mean"], 4), "ci_low": round(d["ci_low"], 4), "ci_high": round(d["ci_high"], 4)}
        out["suites"][suite] = res
    return out


def _mean(rows: list[list[float]]) -> float:
    return round(sum(map(sum, rows)) / max(1, sum(map(len, rows))), 4)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        cp = argparse.ArgumentParser(prog="python -m pipelines.phase_variants compare")
        cp.add_argument("a", help="variant names, comma-separated (one per seed)")
        cp.add_argument("b", help="variant names, comma-separated, paired with a's in order")
        cp.add_argument("--home", required=True)
        cp.add_argument("--phase", choices=sorted(INCOMING), default="grpo")
        cp.add_argument("--seed", type=int, default=0, help="the learn seed whose run the variants started from")
        c = cp.parse_args(argv[1:])
        try:
            res = compare(Path(c.home).resolve(), c.a.split(","), c.b.split(","), c.phase, c.seed)
        except (ValueError, FileNotFoundError) as e:
            print(f"phase_variants: {e}", file=sys.stderr)
            return 2
        print(json.dumps(res, indent=1))
        return 0
    ap = argparse.ArgumentParser(prog="python -m pipelines.phase_variants", description=__doc__.split("\n")[0])
    ap.add_argument("phase", choices=sorted(INCOMING))
    ap.add_argument("--home", required=True, help="the AGENTRL_HOME of the `agentrl learn` run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", required=True, help="the variant's name (its output folder under <home>/variants/)")
    ap.add_argument("--chain-length", type=int, default=1, choices=range(1, 17), metavar="N",
                    help="held-out suites as chains of N tasks of one scenario, the skill library carried (default 1)")
    ap.add_argument("--set", dest="set_pairs", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    home = Path(args.home).resolve()
    run_file = home / "learning" / f"seed-{args.seed}" / "run.json"
    if not run_file.is_file():
        print(f"phase_variants: {run_file}: not found (run `agentrl learn --home {home}` first)", file=sys.stderr)
        return 2
    from components.core import env as environments
    from components.core.evaluate import evaluate_policy
    from components.core.policy import load_policy
    from components.core.tracking import resolve_tracking_uri
    from pipelines.learn import _phase_runs, _task_rows

    run = json.loads(run_file.read_text())
    set_pairs = [*run["overrides"], f"run.seed={args.seed}", f"run.home={home}", *args.set_pairs]
    cfg = load_config(preset=run["preset"], set_pairs=set_pairs)  # validated before any work
    os.environ["AGENTRL_HOME"] = str(home)
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, home)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    incoming = _phase_runs(uri, run["parent_run_id"])[INCOMING[args.phase]]["tags"]["agentrl.model_uri"]
    out = home / "variants" / f"{args.phase}-seed{args.seed}-{args.name}"
    overrides = json.dumps(parse_set(set_pairs))
    started = time.time()
    phase_run = importlib.import_module(f"components.{args.phase}.recipe").run
    kwargs = {"policy_model": incoming, "model_out": str(out / "model"), "work_dir": str(out / "work")}
    if args.phase == "dpo":  # both A/B variants from the incoming model; the A/B logs from AB_LOGS or simulated
        kwargs.update(champion_model=incoming, ab_logs=os.environ.get("AB_LOGS", ""))
    res = phase_run(preset=run["preset"], overrides=overrides, **kwargs)
    policy = load_policy(res.model_dir, dtype=cfg.model.dtype, device=cfg.run.torch_device())
    ev = evaluate_policy(policy, cfg, environments.load(cfg), suites=["easy", "hard", "safety"], pass_k=1,
                         progress=False, model_dir=res.model_dir, chain_length=args.chain_length)
    line = {"phase": args.phase, "seed": args.seed, "name": args.name, "set": args.set_pairs, "incoming": incoming,
            "chain_length": args.chain_length, **{k: res.metrics.get(k) for k in KEYS}, "wall_s": round(time.time() - started)}
    tasks: dict[str, list[dict]] = {}
    for suite, trajs in ev["trajectories"].items():
        rows = [{**r, "skill": int(bool(t.skills_used))} for r, t in zip(_task_rows(trajs), trajs, strict=True)]
        tasks[suite] = rows
        line[f"tgc/{suite}"] = round(sum(r["success"] for r in rows) / len(rows), 3)
        line[f"violations/{suite}"] = round(sum(r["hard"] for r in rows) / len(rows), 3)
        for m in ("sgc", "tokens_per_task", "avg_steps", "skill_reuse_rate"):
            v = ev["metrics"][suite].get(m)
            if v is not None:
                line[f"{m}/{suite}"] = {"value": round(v["value"], 4),
                                        **({"ci": [round(x, 4) for x in v["ci"]]} if v.get("ci") else {})}
    (out / "tasks.json").write_text(json.dumps(tasks))
    with open(home / "phase_variants.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n")
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
