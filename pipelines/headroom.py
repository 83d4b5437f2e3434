"""What reinforcement learning can lift on the held-out suites: for each model of a `make learn` seed's chain, every
held-out task's greedy outcome (what the evaluation scores) beside its success rate over k sampled attempts (what
GRPO's groups and rejection sampling's best-of-N see). A greedy failure that no sample ever solves gives an online
phase no signal on that kind of task; a greedy success that samples often miss is where sampling-time RL sharpens a
policy without moving its greedy score. Outside CI (minutes a model on the tiny preset).

    python -m pipelines.headroom --home .agentrl --seed 0 --models sft,grpo --samples 6 --temperature 1.0

Writes `<home>/learning/seed-<n>/headroom-T<temperature>.json` (per model and suite: tasks, greedy successes, the
greedy failures any sample solved, the mean sampled success rate on greedy failures and on greedy successes, and the
mean sampled success over all tasks with its bootstrap interval over tasks; each later model's gain in it over the
first, paired task by task) and prints one line a model and suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from components.core.config import load_config


def summarize(greedy: list[int], rates: list[float], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """One suite of one model: greedy and sampled outcomes of the same tasks, in the same order."""
    from pipelines.learn import bootstrap_mean

    if len(greedy) != len(rates) or not greedy:
        raise ValueError(f"headroom: expected one sampled rate per greedy outcome, got {len(rates)} and {len(greedy)}")
    failed = [r for g, r in zip(greedy, rates, strict=True) if not g]
    solved = [r for g, r in zip(greedy, rates, strict=True) if g]
    ci = bootstrap_mean([list(rates)], n_boot=n_boot, seed=seed)
    return {"tasks": len(greedy), "greedy_solved": sum(greedy), "failed_any_sample": sum(r > 0 for r in failed),
            "sampled_rate_on_failed": round(sum(failed) / len(failed), 4) if failed else None,
            "sampled_rate_on_solved": round(sum(solved) / len(solved), 4) if solved else None,
            "sampled_success": {"value": round(ci["mean"], 4), "ci": [round(ci["ci_low"], 4), round(ci["ci_high"], 4)]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.headroom", description=__doc__.split("\n")[0])
    ap.add_argument("--home", required=True, help="the AGENTRL_HOME of the `agentrl learn` run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="sft,grpo", help="models of the seed's chain, comma-separated")
    ap.add_argument("--suites", default="easy,hard")
    ap.add_argument("--samples", type=int, default=6, help="sampled attempts a task (k)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--set", dest="set_pairs", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    home = Path(args.home).resolve()
    seed_dir = home / "learning" / f"seed-{args.seed}"
    if not (seed_dir / "outcomes.json").is_file():
        print(f"headroom: {seed_dir / 'outcomes.json'}: not found (run `agentrl learn --home {home}` first)",
              file=sys.stderr)
        return 2
    if args.samples < 1 or not 0 < args.temperature <= 5:
        print(f"headroom: expected --samples >= 1 and 0 < --temperature <= 5, got {args.samples} and "
              f"{args.temperature}", file=sys.stderr)
        return 2
    run = json.loads((seed_dir / "run.json").read_text())
    outcomes = json.loads((seed_dir / "outcomes.json").read_text())
    models, suites = args.models.split(","), args.suites.split(",")
    unknown = [m for m in models if m not in outcomes["model_uris"]]
    if unknown:
        print(f"headroom: --models {unknown}: expected some of {sorted(outcomes['model_uris'])}", file=sys.stderr)
        return 2
    cfg = load_config(preset=run["preset"], set_pairs=[*run["overrides"], f"run.seed={args.seed}", f"run.home={home}",
                                                       *args.set_pairs])  # validated before any work
    os.environ["AGENTRL_HOME"] = str(home)
    from components.core import env as environments
    from components.core.generation import make_backend
    from components.core.policy import load_policy
    from components.core.rollout import RolloutSettings, rollout
    from components.core.tiny import set_torch_threads
    from components.core.tokens import ChatFormat

    set_torch_threads(cfg.run.torch_threads)
    sandbox = environments.load(cfg)
    missing = [s for s in suites if s not in sandbox.suites or s not in outcomes["models"][models[0]]]
    if missing:
        print(f"headroom: --suites {missing}: expected held-out suites the seed was measured on", file=sys.stderr)
        return 2
    k = args.samples
    out: dict[str, Any] = {"seed": args.seed, "samples": k, "temperature": args.temperature, "models": {}}
    for name in models:
        uri = outcomes["model_uris"][name]
        policy = load_policy(uri, dtype=cfg.model.dtype, device=cfg.run.torch_device(), cache=str(home / "cache"))
        backend = make_backend(cfg.generation.backend, policy.model, policy.tokenizer, cfg.generation, model_dir=uri,
                               device=cfg.run.torch_device())
        out["models"][name] = {}
        for suite in suites:
            greedy = {r["task"]: r["success"] for r in outcomes["models"][name][suite]}  # as `agentrl learn` measured
            tasks = [t for t in sandbox.suites[suite] if t.id in greedy]
            settings = RolloutSettings.from_config(cfg, group_size=k, temperature=args.temperature,
                                                   policy_name=f"headroom-{name}")
            sampled = rollout(backend, sandbox.factory(), ChatFormat(policy.tokenizer), tasks, settings,
                              rewards=cfg.rewards)
            rates = [sum(t.verdict.success for t in sampled[i * k:(i + 1) * k]) / k for i in range(len(tasks))]
            res = summarize([greedy[t.id] for t in tasks], rates, cfg.eval.bootstrap_samples, args.seed)
            res["per_task"] = {t.id: {"greedy": greedy[t.id], "sampled": r} for t, r in zip(tasks, rates, strict=True)}
            out["models"][name][suite] = res
            print(f"headroom: seed {args.seed} {name} {suite}: greedy {res['greedy_solved']}/{res['tasks']}, greedy "
                  f"failures any of {k} samples solved {res['failed_any_sample']}, sampled success "
                  f"{res['sampled_success']['value']} {res['sampled_success']['ci']} (on greedy failures "
                  f"{res['sampled_rate_on_failed']}, on greedy successes {res['sampled_rate_on_solved']})", flush=True)
    from pipelines.learn import bootstrap_mean

    first = models[0]
    for name in models[1:]:  # each later model against the first, paired task by task
        for suite in suites:
            a, b = out["models"][first][suite]["per_task"], out["models"][name][suite]["per_task"]
            d = bootstrap_mean([[b[t]["sampled"] - a[t]["sampled"] for t in a]], cfg.eval.bootstrap_samples,
                               seed=args.seed)
            out["models"][name][suite][f"sampled_gain_over_{first}"] = {
                "value": round(d["mean"], 4), "ci": [round(d["ci_low"], 4), round(d["ci_high"], 4)]}
            print(f"headroom: seed {args.seed} {suite}: sampled success {name} - {first} {d['mean']:+.4f} "
                  f"[{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]")
    path = seed_dir / f"headroom-T{args.temperature:g}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"headroom: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
