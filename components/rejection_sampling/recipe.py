"""Rejection sampling (best-of-N, then SFT on the best), top to bottom.

1. Resolve the config; open the phase run; load the sandbox and the incoming policy.
2. Probe: `probe_samples` sampled attempts on each of `probe_tasks` tasks (a seeded sample across the probed
   `levels` of `task_pool`: by default the levels of the suite the gain is measured on, from the practice
   suite where a level has instances no SFT demo shows) estimate the incoming policy's success per task.
3. Hard tasks: success in (hard_success_min, hard_success_max] — solvable sometimes, not reliably.
4. Best-of-N: `num_samples` attempts per hard task (the probe's attempts count); keep the top k per
   task: solved without a hard violation, then higher reward, fewer steps, fewer tokens; near-duplicate
   action sequences (difflib similarity >= dedup_similarity) removed.
5. SFT on the kept trajectories with `core.training.train_sft`, as the SFT phase trains (loss on agent tokens only).
   A KFP retry reuses the kept set an earlier attempt published and resumes the SFT from its checkpoint.
6. Measure the gain on a held-out suite (hard by default) against the incoming policy; save.

No hard task (a policy that never or always succeeds) means nothing to learn from: the incoming model
passes through unchanged and the run says so (`tasks_covered` = 0) — never a silent no-op.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter, defaultdict
from typing import Unpack

from components.core.buffer import TrajectoryBuffer
from components.core.env import LoadedEnvironment, interleave_families, pick_suites
from components.core.generation import make_backend
from components.core.phase import PhaseContext, PhaseResult, Places
from components.core.policy import save_policy, trainable_lora
from components.core.rollout import RolloutSettings, rollout
from components.core.schema import Task, Trajectory, read_jsonl, write_jsonl
from components.core.tokens import ChatFormat, demo_example
from components.core.training import train_sft

PHASE = "rejection_sampling"
KEPT = "kept"  # the stage a retry reuses: the kept trajectories and the metrics of steps 2-4
STAGE_STATE = "stage.json"


def probe_pool(train: list[Task], n: int, seed: int) -> list[Task]:
    """A seeded sample of `n` train tasks, round-robin over levels and, within a level, over its scenario families,
    so every level and family is represented."""
    rng = random.Random(f"rs-probe:{seed}")
    by_level: dict[int, list[Task]] = defaultdict(list)
    for t in train:
        by_level[t.level].append(t)
    for lv, tasks in by_level.items():
        rng.shuffle(tasks)
        by_level[lv] = interleave_families(tasks)[::-1]  # pop() takes from the end
    out: list[Task] = []
    while len(out) < n and any(by_level.values()):
        for lv in sorted(by_level):
            if by_level[lv] and len(out) < n:
                out.append(by_level[lv].pop())
    return out


def clean_success(t: Trajectory) -> bool:
    return t.verdict.success and not any(v.startswith("hard:") for v in t.verdict.violations)


def select_best(samples: list[Trajectory], k: int, similarity: float) -> dict[str, list[Trajectory]]:
    """Per task: the top k clean successes (reward, then fewer steps and tokens), near-duplicates removed."""
    return TrajectoryBuffer([t for t in samples if clean_success(t)]).top_k(k, similarity=similarity)


def eval_suite(env: LoadedEnvironment, name: str) -> str:
    """The suite hard tasks are probed at and the gain measured on: `name`, or another environment's own held-out
    suite (hardest-named last) when it has no suite of that name."""
    return pick_suites(env, [name])[-1]


def best_of_n(cfg, env: LoadedEnvironment, policy, policy_model: str, tracker) -> tuple[list[Trajectory], dict[str, float]]:
    """Steps 2-4: probe the pool's tasks at the probed levels, pick the hard ones, sample N on each, keep the top k."""
    rs = cfg.rejection_sampling
    backend = make_backend(cfg.generation.backend, policy.model, policy.tokenizer, cfg.generation,
                           model_dir=policy_model, device=cfg.run.torch_device())
    fmt = ChatFormat(policy.tokenizer)

    def sample(tasks: list[Task], n: int, seed: int) -> list[Trajectory]:
        settings = RolloutSettings.from_config(cfg, group_size=n, seed=seed, policy_name="rs-sample")
        return rollout(backend, env.factory(), fmt, tasks, settings, rewards=cfg.rewards)

    # 2-3. probe, pick the hard tasks
    suite = eval_suite(env, rs.eval_suite)
    levels = set(rs.levels or {t.level for t in env.suites[suite]})
    pool = [t for t in env.online_tasks(rs.task_pool) if t.level in levels]
    if not pool:
        raise ValueError(f"rejection_sampling.levels={sorted(levels)}: the {rs.task_pool} pool has no task at these levels")
    probes = sample(probe_pool(pool, rs.probe_tasks, cfg.run.seed), rs.probe_samples, cfg.run.seed)
    rate = TrajectoryBuffer(probes).success_rate()
    hard_ids = {t for t, r in rate.items() if rs.hard_success_min < r <= rs.hard_success_max}
    by_id = {t.id: t for t in pool}
    hard = [by_id[t] for t in sorted(hard_ids)]
    metrics: dict[str, float] = {"probe_tasks": float(len(rate)), "hard_tasks": float(len(hard)),
                                 "probe_success": sum(rate.values()) / max(1, len(rate))}
    for lv in sorted(levels):
        rates = [r for t, r in rate.items() if by_id[t].level == lv]
        if rates:
            metrics[f"probe_success/L{lv}"] = sum(rates) / len(rates)
            metrics[f"hard_tasks/L{lv}"] = float(sum(by_id[t].level == lv for t in hard_ids))
    tracker.log_metrics(metrics, step=0)

    # 4. best-of-N on the hard tasks
    samples = [t for t in probes if t.task_id in hard_ids]
    if hard and rs.num_samples > rs.probe_samples:
        samples += sample(hard, rs.num_samples - rs.probe_samples, cfg.run.seed + 1)
    kept = select_best(samples, rs.top_k, rs.dedup_similarity)
    chosen = [t for ts in kept.values() for t in ts]
    level = {t.id: t.level for t in hard}
    sampled_lv, kept_lv = Counter(level[t.task_id] for t in samples), Counter(level[t.task_id] for t in chosen)
    metrics.update({"samples": float(len(samples)), "kept": float(len(chosen)), "tasks_covered": float(len(kept)),
                    "acceptance_rate": len(chosen) / max(1, len(samples))})
    metrics.update({f"acceptance_rate/L{lv}": kept_lv[lv] / n for lv, n in sorted(sampled_lv.items())})
    tracker.log_metrics(metrics, step=0)
    return chosen, metrics


def run(preset: str = "tiny", overrides: str = "", policy_model: str = "", **places: Unpack[Places]) -> PhaseResult:
    ctx = PhaseContext.setup(PHASE, preset, overrides, incoming=policy_model, **places)  # validated before any work
    cfg, rs = ctx.cfg, ctx.cfg.rejection_sampling
    # a KFP retry of this step reuses the kept set of the attempt before it and resumes its SFT
    ckpts = ctx.trainer_checkpoints(cfg.sft.checkpoint_every, cfg.sft.keep_checkpoints, cfg.sft.resume)
    kept_dir = ckpts.store.stage(KEPT) if cfg.sft.resume else None
    prior = json.loads((kept_dir / STAGE_STATE).read_text()) if kept_dir is not None else {}
    with ctx.open(resume=prior) as tracker:
        policy = ctx.load_policy(policy_model, lora=False)
        if kept_dir is not None:  # steps 2-4 finished in an earlier attempt (their metrics are logged already)
            chosen = list(read_jsonl(str(kept_dir / "trajectories.jsonl"), Trajectory))
            metrics: dict[str, float] = prior["metrics"]
            tracker.set_tags({"agentrl.rejection_sampling.resumed": "the kept set of an earlier attempt"})
        else:
            chosen, metrics = best_of_n(cfg, ctx.environment(), policy, policy_model, tracker)
            kept_dir = ctx.work / KEPT
            write_jsonl(kept_dir / "trajectories.jsonl", chosen)
            (kept_dir / STAGE_STATE).write_text(json.dumps(
                {"run_id": tracker.run_id, "parent_run_id": tracker.parent_run_id, "metrics": metrics}, indent=1))
            ckpts.store.put_stage(KEPT, kept_dir)

        # 5. SFT on the best, with the shared training kit
        out = ctx.out
        card = ctx.card(policy_model, kept=len(chosen), hard_tasks=int(metrics["hard_tasks"]))
        if chosen:
            if cfg.model.lora.enabled:
                policy = trainable_lora(policy, cfg.model.lora)
            sft = cfg.sft.model_copy(update={"epochs": rs.sft_epochs, "learning_rate": rs.sft_learning_rate,
                                             "max_steps": -1})
            stats = train_sft(policy, [demo_example(t) for t in chosen], sft, ctx.work / "trainer", cfg.run.seed,
                              tracker, use_cpu=cfg.run.torch_device() != "cuda", metric_prefix="sft/", checkpoints=ckpts)
            metrics.update({f"sft/{k}": v for k, v in stats.items()})
            save_policy(policy, out, card, merge=False)
        else:  # nothing to learn from: the incoming model passes through, and the metrics say so
            tracker.set_tags({"agentrl.rs.skipped": "no hard task with a clean success"})
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(policy_model, out)
        # 6. the gain, on held-out tasks (a passed-through model has the incoming weights: not re-measured)
        suite = eval_suite(ctx.environment(), cfg.rejection_sampling.eval_suite)
        metrics.update(ctx.before_after(policy_model, str(out) if chosen else None, [suite]))
        tgc = f"{suite}/tgc"
        metrics[f"gain/{tgc}"] = metrics[tgc] - metrics[f"incoming/{tgc}"]
        tracker.log_metrics(metrics, step=1)
        card.metrics = dict(metrics)
        return ctx.finish(out, card, metrics, stored={KEPT: kept_dir})
