"""Rejection sampling (best-of-N, then SFT on the best), top to bottom.

1. Resolve the config; open the phase run; load the sandbox and the incoming policy.
2. Probe: `probe_samples` sampled attempts on each of `probe_tasks` tasks (a seeded sample across the probed
   `levels` of `task_pool`: by default the levels of the suite the gain is measured on, from the practice
   suite where a level has instances no SFT demo shows) estimate the incoming policy's success per task.
3. Hard tasks: success in (hard_success_min, hard_success_max] — solvable sometimes, not reliably.
4. Best-of-N: `num_samples` attempts per hard task (the probe's attempts count); keep the top k per
   task: solved without a hard violation, then higher reward, fewer steps, fewer tokens; near-duplicate
   action sequences (difflib similarity >= dedup_similarity) removed.
5. SFT on the kept trajectories with the SFT phase's own `train_sft` (loss on agent tokens only).
   A KFP retry reuses the kept set an earlier attempt published and resumes the SFT from its checkpoint.
6. Measure the gain on a held-out suite (hard by default) against the incoming policy; save.

No hard task (a policy that never or always succeeds) means nothing to learn from: the incoming model
passes through unchanged and the run says so (`tasks_covered` = 0) — never a silent no-op.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from components.core import storage
from components.core.buffer import TrajectoryBuffer
from components.core.checkpoint import TrainerCheckpoints, phase_root
from components.core.generation import make_backend
from components.core.policy import load_policy, save_policy, trainable_lora
from components.core.rollout import RolloutSettings, rollout
from components.core.schema import ModelCard, Task, Trajectory, read_jsonl, write_jsonl
from components.core.tokens import ChatFormat
from components.core.tracking import phase_run, setup_phase

PHASE = "rejection_sampling"
KEPT = "kept"  # the stage a retry reuses: the kept trajectories and the metrics of steps 2-4
STAGE_STATE = "stage.json"


@dataclass
class RSResult:
    parent_run_id: str
    run_id: str
    model_dir: str
    model_uri: str
    metrics: dict[str, float] = field(default_factory=dict)


def probe_pool(train: list[Task], n: int, seed: int) -> list[Task]:
    """A seeded sample of `n` train tasks, round-robin over levels so every level is represented."""
    rng = random.Random(f"rs-probe:{seed}")
    by_level: dict[int, list[Task]] = defaultdict(list)
    for t in train:
        by_level[t.level].append(t)
    for tasks in by_level.values():
        rng.shuffle(tasks)
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


def _best_of_n(cfg, sandbox, policy, policy_model: str, tracker) -> tuple[list[Trajectory], dict[str, float]]:
    """Steps 2-4: probe the pool's tasks at the probed levels, pick the hard ones, sample N on each, keep the top k."""
    from components.sandbox.env import WorkspaceEnv

    rs = cfg.rejection_sampling
    backend = make_backend(cfg.generation.backend, policy.model, policy.tokenizer, cfg.generation,
                           model_dir=policy_model, device=cfg.run.torch_device())
    fmt = ChatFormat(policy.tokenizer)

    def sample(tasks: list[Task], n: int, seed: int) -> list[Trajectory]:
        settings = RolloutSettings.from_config(cfg, group_size=n, seed=seed, policy_name="rs-sample")
        return rollout(backend, lambda: WorkspaceEnv(sandbox.world, cfg.sandbox, cfg.rewards), fmt, tasks,
                       settings, rewards=cfg.rewards)

    # 2-3. probe, pick the hard tasks
    levels = set(rs.levels or {t.level for t in sandbox.suites[rs.eval_suite]})
    pool = [t for t in sandbox.online_tasks(rs.task_pool) if t.level in levels]
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


def run(
    preset: str = "tiny",
    overrides: str = "",
    policy_model: str = "",
    world: str = "",
    tasks_dir: str = "",
    parent_run_id: str | None = None,
    model_out: str | None = None,
) -> RSResult:
    cfg, home, storage_root = setup_phase(preset, overrides)  # validated before any work
    if not policy_model:
        raise ValueError("rejection_sampling: no incoming policy (policy_model) to start from")
    from components.evaluation.evaluate import quick_eval
    from components.sandbox.suites import load_sandbox, world_beside
    from components.sft.trainer import demo_example, train_sft

    rs = cfg.rejection_sampling
    world = world_beside(tasks_dir, world) or ""
    # a KFP retry of this step reuses the kept set of the attempt before it and resumes its SFT
    ckpts = TrainerCheckpoints(phase_root(storage_root, parent_run_id, PHASE),
                               home / "staging" / PHASE / (parent_run_id or "standalone"), cfg.sft.checkpoint_every,
                               cfg.sft.keep_checkpoints, cfg.sft.resume)
    kept_dir = ckpts.store.stage(KEPT) if cfg.sft.resume else None
    prior = json.loads((kept_dir / STAGE_STATE).read_text()) if kept_dir is not None else {}
    with phase_run(PHASE, config=cfg, parent_run_id=parent_run_id or prior.get("parent_run_id") or None,
                   close_parent=False, resume_run_id=prior.get("run_id")) as tracker:
        work = Path(os.environ.get("AGENTRL_RS_WORKDIR") or home / "runs" / tracker.run_id / PHASE)
        work.mkdir(parents=True, exist_ok=True)
        sandbox = load_sandbox(cfg, world or None, tasks_dir or None)
        policy = load_policy(policy_model, dtype="bfloat16" if cfg.sft.bf16 else "float32", trainable=True,
                             cache=home / "cache")
        if kept_dir is not None:  # steps 2-4 finished in an earlier attempt (their metrics are logged already)
            chosen = list(read_jsonl(str(kept_dir / "trajectories.jsonl"), Trajectory))
            metrics: dict[str, float] = prior["metrics"]
            tracker.set_tags({"agentrl.rejection_sampling.resumed": "the kept set of an earlier attempt"})
        else:
            chosen, metrics = _best_of_n(cfg, sandbox, policy, policy_model, tracker)
            kept_dir = work / KEPT
            write_jsonl(kept_dir / "trajectories.jsonl", chosen)
            (kept_dir / STAGE_STATE).write_text(json.dumps(
                {"run_id": tracker.run_id, "parent_run_id": tracker.parent_run_id, "metrics": metrics}, indent=1))
            ckpts.store.put_stage(KEPT, kept_dir)

        # 5. SFT on the best, with the SFT phase's recipe
        out = Path(model_out) if model_out else work / "model"
        card = ModelCard(base_model=policy_model, phase=PHASE, parent_run_id=tracker.parent_run_id,
                         run_id=tracker.run_id, extra={"kept": len(chosen), "hard_tasks": int(metrics["hard_tasks"])})
        if chosen:
            if cfg.model.lora.enabled:
                policy = trainable_lora(policy, cfg.model.lora)
            sft = cfg.sft.model_copy(update={"epochs": rs.sft_epochs, "learning_rate": rs.sft_learning_rate,
                                             "max_steps": -1})
            stats = train_sft(policy, [demo_example(t) for t in chosen], sft, work / "trainer", cfg.run.seed, tracker,
                              use_cpu=cfg.run.torch_device() != "cuda", metric_prefix="sft/", checkpoints=ckpts)
            metrics.update({f"sft/{k}": v for k, v in stats.items()})
            save_policy(policy, out, card, merge=False)
        else:  # nothing to learn from: the incoming model passes through, and the metrics say so
            tracker.set_tags({"agentrl.rs.skipped": "no hard task with a clean success"})
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(policy_model, out)
        # 6. the gain, on held-out tasks
        suite = [rs.eval_suite]
        before = quick_eval(policy_model, cfg, tasks_dir or None, suite, world or None)
        # a passed-through model has the incoming weights: its greedy numbers are the same, not re-measured
        after = quick_eval(str(out), cfg, tasks_dir or None, suite, world or None) if chosen else dict(before)
        metrics.update({f"incoming/{k}": v for k, v in before.items()})
        metrics.update(after)
        metrics[f"gain/{rs.eval_suite}/tgc"] = after[f"{rs.eval_suite}/tgc"] - before[f"{rs.eval_suite}/tgc"]
        tracker.log_metrics(metrics, step=1)
        card.metrics = dict(metrics)
        uri = tracker.store_model(out, storage_root, card)
        storage.put_dir(kept_dir, tracker.storage_uri(storage_root, KEPT))
        return RSResult(tracker.parent_run_id, tracker.run_id, str(out), uri, metrics)
