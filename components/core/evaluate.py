"""Running a policy on the held-out suites and measuring it (the shared evaluation kit: every phase measures its
model with it, the evaluation phase on every held-out suite), with bootstrap confidence intervals.

Metrics per suite: TGC (task goal completion), SGC (scenario goal completion: every task of a
scenario solved), pass@k (k sampled attempts), average steps, generated tokens per task, safety
violation rate (episodes with a hard violation), format error rate and valid-action rate (per
action), skill reuse rate (episodes that called a retrieved skill). Greedy decoding is deterministic:
the same model evaluated twice gives the same numbers.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from components.core import env as environments
from components.core.config import PipelineConfig
from components.core.env import LoadedEnvironment
from components.core.generation import make_backend
from components.core.policy import load_policy
from components.core.rollout import RolloutSettings, rollout
from components.core.schema import Task, Trajectory
from components.core.tokens import ChatFormat

__all__ = ["evaluate_model", "evaluate_policy", "flat", "greedy_rollouts", "per_level", "quick_eval", "scenario_chains", "suite_metrics"]


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------
def _episode_stats(t: Trajectory) -> dict[str, float]:
    hard = any(v.startswith("hard:") for v in t.verdict.violations)
    fmt_errors = sum(1 for x in t.turns if x.role == "tool" and x.info.get("format_error"))
    return {"success": float(t.verdict.success), "steps": float(t.steps), "tokens": float(t.generated_tokens),
            "hard": float(hard), "format_errors": float(fmt_errors), "skill": float(bool(t.skills_used))}


def _aggregate(stats: Sequence[dict[str, float]], groups: dict[str, list[int]]) -> dict[str, float]:
    n = max(1, len(stats))
    steps = sum(s["steps"] for s in stats)
    out = {
        "tgc": sum(s["success"] for s in stats) / n,
        "avg_steps": steps / n,
        "tokens_per_task": sum(s["tokens"] for s in stats) / n,
        "safety_violation_rate": sum(s["hard"] for s in stats) / n,
        "format_error_rate": sum(s["format_errors"] for s in stats) / max(1.0, steps),
        "skill_reuse_rate": sum(s["skill"] for s in stats) / n,
    }
    out["valid_action_rate"] = 1.0 - out["format_error_rate"]
    if groups:
        out["sgc"] = sum(all(stats[i]["success"] for i in idx) for idx in groups.values()) / len(groups)
    return out


def suite_metrics(trajs: Sequence[Trajectory], samples: Sequence[Sequence[Trajectory]] = (), n_boot: int = 1000,
                  confidence: float = 0.95, seed: int = 0) -> dict[str, dict[str, Any]]:
    """{metric: {"value", "ci": [lo, hi]}}; the bootstrap resamples scenarios (tasks within them kept together)."""
    stats = [_episode_stats(t) for t in trajs]
    scen: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        scen[t.meta.get("scenario_id", t.task_id)].append(i)
    point = _aggregate(stats, scen)
    if samples:
        point["pass_at_k"] = sum(any(x.verdict.success for x in group) for group in samples) / max(1, len(samples))
    rng = random.Random(seed)
    keys = list(scen)
    boots: dict[str, list[float]] = defaultdict(list)
    for _ in range(n_boot):
        pick = [rng.choice(keys) for _ in keys]
        idx, groups = [], {}
        for j, k in enumerate(pick):
            members = list(range(len(idx), len(idx) + len(scen[k])))
            idx += scen[k]
            groups[f"{j}"] = members
        agg = _aggregate([stats[i] for i in idx], groups)
        if samples:
            sample_pick = [rng.randrange(len(samples)) for _ in samples]
            agg["pass_at_k"] = sum(any(x.verdict.success for x in samples[i]) for i in sample_pick) / len(samples)
        for m, v in agg.items():
            boots[m].append(v)
    lo_q, hi_q = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    out = {}
    for m, v in point.items():
        b = sorted(boots[m])
        out[m] = {"value": round(v, 6),  # n_boot=0: the point values only
                  "ci": [round(b[int(lo_q * (len(b) - 1))], 6), round(b[int(hi_q * (len(b) - 1))], 6)] if b else None}
    return out


def per_level(trajs: Sequence[Trajectory]) -> dict[int, float]:
    by: dict[int, list[float]] = defaultdict(list)
    for t in trajs:
        by[int(t.meta.get("level", 0))].append(float(t.verdict.success))
    return {lv: sum(v) / len(v) for lv, v in sorted(by.items())}


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------
def evaluate_model(
    model_uri: str,
    cfg: PipelineConfig,
    sandbox: LoadedEnvironment,
    suites: Sequence[str] | None = None,
    pass_k: int | None = None,
    max_tasks: int | None = None,
    cache: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Greedy on every task of each suite (+ k samples for pass@k). Returns metrics and trajectories."""
    policy = load_policy(model_uri, dtype=cfg.model.dtype, device=cfg.run.torch_device(),
                         cache=cache)
    return evaluate_policy(policy, cfg, sandbox, suites, pass_k, max_tasks, progress, model_dir=model_uri)


def scenario_chains(tasks: Sequence[Task], length: int) -> list[list[Task]]:
    """The suite's tasks as sequential chains: up to `length` tasks of one scenario each, in suite order (the
    skill library an episode leaves is the next one's, as in SAGE's sequential rollout)."""
    by: dict[str, list[Task]] = defaultdict(list)
    for t in tasks:
        by[t.scenario_id].append(t)
    return [ts[i:i + length] for ts in by.values() for i in range(0, len(ts), length)]


def greedy_rollouts(backend: Any, make_env: Callable[[], Any], fmt: ChatFormat, cfg: PipelineConfig,
                    tasks: Sequence[Task], chain_length: int = 1, progress: bool = False) -> list[Trajectory]:
    """One greedy episode per task (as `scenario_chains` when `chain_length` > 1): what every evaluation measures."""
    runs = scenario_chains(tasks, chain_length) if chain_length > 1 else tasks
    return rollout(backend, make_env, fmt, runs, RolloutSettings.from_config(cfg, temperature=0.0, policy_name="eval",
                                                                            progress=progress), rewards=cfg.rewards)


def evaluate_policy(policy, cfg: PipelineConfig, sandbox: LoadedEnvironment, suites: Sequence[str] | None = None,
                    pass_k: int | None = None, max_tasks: int | None = None, progress: bool = True,
                    model_dir: str | None = None, env_factory: Callable[[], Any] | None = None,
                    backend: Any = None, chain_length: int = 1) -> dict[str, Any]:
    """Greedy (and pass@k) held-out metrics per suite. `chain_length` > 1 runs each suite as chains of tasks of
    one scenario whose skill library carries over (`scenario_chains`): `skill_reuse_rate` then counts calls to
    skills an earlier task of the chain wrote; 1 runs every task on its own. `suites`: default, the environment's
    held-out ones (those it has of the names given; its held-out ones when it has none: `core.env.pick_suites`)."""
    fmt = ChatFormat(policy.tokenizer)
    if backend is None:
        backend = make_backend(cfg.generation.backend, policy.model, policy.tokenizer, cfg.generation,
                               model_dir=model_dir, device=cfg.run.torch_device())
    k = cfg.eval.pass_k if pass_k is None else pass_k
    make_env = env_factory or sandbox.factory()
    results: dict[str, Any] = {"metrics": {}, "trajectories": {}, "levels": {}}
    for suite in environments.pick_suites(sandbox, suites or sandbox.heldout):
        tasks = sandbox.suites[suite][:max_tasks] if max_tasks else sandbox.suites[suite]
        greedy = greedy_rollouts(backend, make_env, fmt, cfg, tasks, chain_length, progress)
        samples: list[list[Trajectory]] = []
        if k > 1:
            sampled = rollout(backend, make_env, fmt, tasks,
                              RolloutSettings.from_config(cfg, group_size=k, policy_name="eval-sample",
                                                          progress=progress), rewards=cfg.rewards)
            samples = [sampled[i * k:(i + 1) * k] for i in range(len(tasks))]
        results["metrics"][suite] = suite_metrics(greedy, samples, cfg.eval.bootstrap_samples, cfg.eval.confidence,
                                                  cfg.run.seed)
        results["trajectories"][suite] = greedy
        results["levels"][suite] = per_level(greedy)
    return results


def flat(metrics: dict[str, dict[str, dict[str, Any]]], prefix: str = "") -> dict[str, float]:
    """{'easy': {'tgc': {'value': .5, 'ci': [.3, .7]}}} -> {'easy/tgc': .5, 'easy/tgc_ci_lo': .3, 'easy/tgc_ci_hi': .7}
    (the bootstrap interval kept for TGC, the number every phase is judged by)."""
    out = {}
    for s, ms in metrics.items():
        for m, v in ms.items():
            out[f"{prefix}{s}/{m}"] = v["value"]
            if m == "tgc" and v.get("ci"):
                out[f"{prefix}{s}/tgc_ci_lo"], out[f"{prefix}{s}/tgc_ci_hi"] = v["ci"]
    return out


def quick_eval(model_dir: str, cfg: PipelineConfig, tasks_dir: str | None, suites: Sequence[str],
               world_path: str | None = None) -> dict[str, float]:
    """Greedy TGC etc. on a few held-out suites (no pass@k): what training phases log as their held-out metrics."""
    sandbox = environments.load(cfg, world_path, tasks_dir)
    res = evaluate_model(model_dir, cfg, sandbox, suites, pass_k=1, progress=False)
    return flat(res["metrics"])
