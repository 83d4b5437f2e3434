"""One phase again, on what a `make learn` seed's run handed it, with `--set` variants: how the README's DPO variant
table was measured (outside CI; minutes a variant on the tiny preset).

    python -m pipelines.phase_variants dpo --home .agentrl --seed 0 --name rpo --set dpo.sft_weight=1
    AB_LOGS=<simulated.jsonl> python -m pipelines.phase_variants dpo ...   # every variant on the same A/B logs

`dpo` starts from the seed's rejection-sampling model (variant A and B both), `grpo` from its SFT model. The phase
runs in this process with the seed run's overrides plus the variant's; its model is then measured greedily on the
easy, hard and safety suites. One JSON line a variant is appended to `<home>/phase_variants.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from components.core.config import load_config, parse_set

INCOMING = {"dpo": "rejection_sampling", "grpo": "sft"}
KEYS = ("pairs_train", "pairs_heldout", "heldout/rewards/accuracies", "heldout_before/logps/chosen",
        "heldout/logps/chosen", "train_steps", "incoming/safety/safety_violation_rate", "safety/safety_violation_rate")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.phase_variants", description=__doc__.split("\n")[0])
    ap.add_argument("phase", choices=sorted(INCOMING))
    ap.add_argument("--home", required=True, help="the AGENTRL_HOME of the `agentrl learn` run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", required=True, help="the variant's name (its output folder under <home>/variants/)")
    ap.add_argument("--set", dest="set_pairs", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    home = Path(args.home).resolve()
    run_file = home / "learning" / f"seed-{args.seed}" / "run.json"
    if not run_file.is_file():
        print(f"phase_variants: {run_file}: not found (run `agentrl learn --home {home}` first)", file=sys.stderr)
        return 2
    from components.core import env as environments
    from components.core.evaluate import evaluate_model
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
    if args.phase == "dpo":
        from components.dpo.recipe import run as phase_run

        res = phase_run(preset=run["preset"], overrides=overrides, policy_model=incoming, champion_model=incoming,
                        ab_logs=os.environ.get("AB_LOGS", ""), model_out=str(out / "model"), work_dir=str(out / "work"))
    else:
        from components.grpo.recipe import run as phase_run

        res = phase_run(preset=run["preset"], overrides=overrides, policy_model=incoming, model_out=str(out / "model"),
                        work_dir=str(out / "work"))
    ev = evaluate_model(res.model_dir, cfg, environments.load(cfg), suites=["easy", "hard", "safety"], pass_k=1,
                        progress=False)
    line = {"phase": args.phase, "seed": args.seed, "name": args.name, "set": args.set_pairs, "incoming": incoming,
            **{k: res.metrics.get(k) for k in KEYS}, "wall_s": round(time.time() - started)}
    for suite, trajs in ev["trajectories"].items():
        rows = _task_rows(trajs)
        line[f"tgc/{suite}"] = round(sum(r["success"] for r in rows) / len(rows), 3)
        line[f"violations/{suite}"] = round(sum(r["hard"] for r in rows) / len(rows), 3)
    with open(home / "phase_variants.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n")
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
