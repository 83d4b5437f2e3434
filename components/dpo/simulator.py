"""The A/B simulator of the embedded default: production's A/B logs, made in the sandbox.

Each request (a sandbox task) is answered by variant A (the incoming champion) and variant B (the
candidate), sampled as in deployment. The simulated user judges with the task's verifier: thumbs up
for a solved task without a hard violation, down otherwise; the thumb is flipped with probability
`noise_rate` (users err). A thumbs-down comes with a correction with probability `correction_rate`:
the reply the expert gives at the first turn where the answer left the expert's path — what a user
who edits the agent's action would write. Records are written in exactly the ABRecord format, so
the DPO phase reads simulated and production logs through the same code.
"""

from __future__ import annotations

import random
from typing import Any

from components.core.config import ABSimulatorConfig, PipelineConfig
from components.core.generation import make_backend
from components.core.rollout import RolloutSettings, rollout
from components.core.schema import ABRecord, Feedback, Task, Trajectory, write_jsonl
from components.core.tokens import ChatFormat


def _hard_violation(t: Trajectory) -> bool:
    return any(v.startswith("hard:") for v in t.verdict.violations)


def expert_correction(traj: Trajectory, expert: Trajectory) -> tuple[int, str] | None:
    """(turn index, expert reply) at the first agent turn that differs from the expert's; None if none does."""
    for i, (a, e) in enumerate(zip(traj.turns, expert.turns, strict=False)):
        if a.role != e.role:
            return None
        if a.text != e.text:
            return (i, e.text) if a.role == "assistant" else None
    return None


def draw_requests(sandbox: Any, sim: ABSimulatorConfig, rng: random.Random) -> list[Task]:
    """The simulated traffic: `sim.requests` tasks of `sim.suite` (at `sim.levels`), each task once before any repeats."""
    pool = sandbox.online_tasks("practice") if sim.suite not in sandbox.suites or sim.suite == "practice" \
        else sandbox.suites[sim.suite]
    pool = [t for t in pool if sim.levels is None or t.level in sim.levels]
    if not pool:
        raise ValueError(f"dpo.simulate.suite={sim.suite!r}, levels={sim.levels}: the sandbox has no tasks there")
    return [pool[i % len(pool)] for i in rng.sample(range(max(len(pool), sim.requests)), sim.requests)]


def _sample(policy: Any, model_dir: str, cfg: PipelineConfig, make_env, tasks: list[Task], name: str, seed: int,
            progress: bool) -> list[Trajectory]:
    """`answers_per_variant` answers to each task, in task order (a task's answers together)."""
    backend = make_backend(cfg.generation.backend, policy.model, policy.tokenizer, cfg.generation,
                           model_dir=model_dir, device=cfg.run.torch_device())
    settings = RolloutSettings.from_config(cfg, seed=seed, policy_name=name, progress=progress,
                                           group_size=cfg.dpo.simulate.answers_per_variant)
    return rollout(backend, make_env, ChatFormat(policy.tokenizer), tasks, settings, rewards=cfg.rewards)


def simulate_ab(
    policy_a: Any, model_a: str, policy_b: Any, model_b: str, cfg: PipelineConfig, sandbox: Any, out_uri: str,
    progress: bool = True,
) -> dict[str, float]:
    """Serve `simulate.requests` sandbox requests to both variants; write ABRecords to `out_uri`."""
    sim = cfg.dpo.simulate
    rng = random.Random(f"ab:{cfg.run.seed}")
    tasks = draw_requests(sandbox, sim, rng)

    make_env = sandbox.factory()

    answers = {"A": _sample(policy_a, model_a, cfg, make_env, tasks, "ab-A", cfg.run.seed, progress),
               "B": _sample(policy_b, model_b, cfg, make_env, tasks, "ab-B", cfg.run.seed + 1, progress)}
    k = sim.answers_per_variant
    records, stats = [], {"requests": float(len(tasks)), "up_A": 0.0, "up_B": 0.0, "flipped": 0.0, "corrections": 0.0}
    experts: dict[str, Trajectory] = {}
    for i, task in enumerate(tasks):
        for variant, model_id, j in [(v, m, j) for v, m in (("A", model_a), ("B", model_b)) for j in range(k)]:
            traj = answers[variant][i * k + j]  # a request's k answers of one variant sit together
            good = traj.verdict.success and not _hard_violation(traj)
            thumb = "up" if good else "down"
            if rng.random() < sim.noise_rate:
                thumb = "down" if thumb == "up" else "up"
                stats["flipped"] += 1
            fb = Feedback(thumb=thumb)
            if thumb == "down" and rng.random() < sim.correction_rate:
                if task.id not in experts:
                    experts[task.id] = sandbox.expert(make_env(), task, action_format="json")
                fix = expert_correction(traj, experts[task.id]) if experts[task.id] is not None else None
                if fix is not None:
                    fb.correction_turn, fb.correction = fix
                    stats["corrections"] += 1
            stats[f"up_{variant}"] += thumb == "up"
            records.append(ABRecord(request_id=f"req-{i:05d}", task_id=task.id, variant=variant, model_id=model_id,
                                    trajectory=traj, feedback=fb, task=task))
    write_jsonl(out_uri, records)
    stats["records"] = float(len(records))
    return stats
