"""GRPO for multi-turn agents, top to bottom (one readable recipe, torchtune-style).

The loop is written here on `accelerate` (one code path: one CPU process, or data parallel over the GPUs
of a pod or of several nodes, with DeepSpeed ZeRO when configured) instead of TRL's GRPOTrainer: its unit is a chain of multi-turn episodes with
observations between agent turns and per-turn advantages, which single-completion trainers cannot
express. `make bench` holds it against TRL on the single-turn case (`grpo.throughput_vs_trl`).

1. Resolve the config (validated before any work); find the latest complete checkpoint.
2. Open the phase's MLflow run (the same run again when resuming); load the sandbox, the policy, the
   reference (SFT) model when beta > 0, the optimizer; restore everything from the checkpoint.
3. Every step:
   a. draw tasks by the curriculum (chains of two tasks of one scenario with SAGE) from `grpo.task_pool`: by
      default the sandbox's practice suite, instances no SFT demo shows (a success there needs what
      generalises, not a memorised demo), the train suite's tasks at a level it lacks;
   b. roll out `group_size` samples of each (the runtime's batched multi-turn loop), optionally with
      one sample per group replaced by the expert's solution (off-policy supervision);
   c. rewards (the sandbox's reward table, or SAGE's skill-integrated reward) -> group advantages
      (trajectory- or turn-level);
   d. clipped surrogate + k3 KL on agent tokens, `epochs_per_batch` optimizer steps;
   e. the collapse monitor; on an alarm (or every K steps) a short SFT repair on expert solutions of
      the tasks the policy failed;
   f. metrics to MLflow; held-out evaluation every `eval_every` steps (best model kept; with
      `eval_chain_length` 2 as chains of two tasks of one scenario, so skill reuse is measured held-out);
      a checkpoint every `checkpoint_every` steps.
4. Save the best (or last) policy as the phase's Model artifact.

Several processes (torchrun; `run_distributed` on a multi-GPU pod, `run_multi_node` for a TrainJob): every
rank draws the same step's tasks and rolls out its share of the groups; gradients are averaged by
accelerate; the episodes are gathered so that the curriculum, the monitor, the repair and the metrics are
the same on every rank; evaluation runs on every rank (ZeRO-3 gathers are collective) and rank 0 tracks.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from components.core.checkpoint import Checkpoints, phase_root
from components.core.config import PipelineConfig
from components.core.generation import make_backend
from components.core.policy import load_policy, save_policy, trainable_lora
from components.core.rewards import sage_rewards
from components.core.rollout import RolloutSettings, rollout
from components.core.schema import ModelCard, Task, Trajectory, Turn
from components.core.tokens import ChatFormat, encode_messages
from components.core.tracking import phase_run, rank, setup_phase
from components.grpo.advantages import group_advantages, turn_advantages, zero_variance
from components.grpo.curriculum import Curriculum
from components.grpo.loss import (
    Sample,
    collate,
    control_prob,
    grpo_loss,
    importance_weights,
    nll_loss,
    sample_from_turns,
    token_logprobs,
)
from components.grpo.monitor import CollapseMonitor, control_token_ids

PHASE = "grpo"


@dataclass
class GRPOResult:
    parent_run_id: str
    run_id: str
    model_dir: str
    model_uri: str
    metrics: dict[str, float] = field(default_factory=dict)
    steps_done: int = 0
    resumed_from: int | None = None


# ----------------------------------------------------------------------------------------------
# Small pieces
# ----------------------------------------------------------------------------------------------
def draw_tasks(cfg: PipelineConfig, curriculum: Curriculum, train: list[Task], step: int) -> list[list[Task]]:
    """This step's chains: one task each, or (SAGE) `chain_length` distinct tasks of one scenario."""
    g = cfg.grpo
    rng = random.Random(f"grpo-tasks:{cfg.run.seed}:{step}")  # a function of the step: no state to save
    pool: dict[int, list[Task]] = defaultdict(list)
    for t in train:
        pool[t.level].append(t)
    firsts = curriculum.sample(pool, g.tasks_per_step, rng)
    if not g.sage.enabled:
        return [[t] for t in firsts]
    by_scenario: dict[str, list[Task]] = defaultdict(list)
    for t in train:
        by_scenario[t.scenario_id].append(t)
    chains = []
    for t in firsts:
        mates = [x for x in by_scenario[t.scenario_id] if x.id != t.id]
        if len(mates) < g.sage.chain_length - 1:  # a scenario of one task: take one that has company
            mates_ok = [s for s, ts in by_scenario.items() if len(ts) >= g.sage.chain_length and ts[0].level == t.level]
            scen = rng.choice(sorted(mates_ok or [s for s, ts in by_scenario.items() if len(ts) >= g.sage.chain_length]))
            t = rng.choice(by_scenario[scen])
            mates = [x for x in by_scenario[scen] if x.id != t.id]
        chains.append([t, *rng.sample(mates, g.sage.chain_length - 1)])
    return chains


def expert_trajectory(env, task: Task, fmt: ChatFormat, action_format: str) -> Trajectory:
    """The sandbox expert's solution, tokenised the way the policy sees it (agent mask from the template)."""
    from components.sandbox.expert import solve_code, solve_json
    from components.sft.trainer import messages

    traj, _ = (solve_code if action_format == "code" else solve_json)(env, task)
    info = env.episode_info()
    traj.skills_defined, traj.skills_used = list(info.get("skills_defined", [])), list(info.get("skills_used", []))
    ids, mask = encode_messages(fmt.tok, messages(traj))
    # one synthetic "turn" carries the whole conversation: its advantage applies to every agent token
    traj.turns = [Turn("assistant", "", tokens=ids, mask=mask)]
    traj.meta = {**traj.meta, "expert": True, "format_errors": 0}
    return traj


def episode_rewards(chains: list[list[Trajectory]], cfg: PipelineConfig) -> list[list[float]]:
    """One reward per episode of each sampled chain: the reward table, or SAGE's skill-integrated reward."""
    if cfg.grpo.sage.enabled and cfg.grpo.sage.chain_length == 2:
        return [sage_rewards(ch, code_form=cfg.sandbox.action_format == "code") for ch in chains]
    return [[t.reward.total for t in ch] for ch in chains]


def advantages_for(groups: list[list[list[Trajectory]]], rewards: list[list[list[float]]], cfg: PipelineConfig):
    """Per episode: its advantage (trajectory credit) or one per agent turn (turn credit); + the fractions of groups
    with zero reward variance and of groups `grpo.group_filter` left without advantage.

    A group is the G samples of one chain; each chain position is normalised within its group.
    """
    g = cfg.grpo
    sage = g.sage.enabled and g.sage.chain_length == 2  # SAGE's reward: no shaping terms, skill reuse counts
    out: dict[int, Any] = {}
    zero = filtered = 0
    n_groups = 0
    for samples, rs in zip(groups, rewards, strict=True):
        for pos in range(len(samples[0])):
            col = [r[pos] for r in rs]
            n_groups += 1
            zero += zero_variance(col)
            trajs = [s[pos] for s in samples]
            if g.group_filter == "progress" and not sage and zero_variance([_progress(t) for t in trajs]):
                for tr in trajs:
                    out[id(tr)] = 0.0  # still in the batch (a constant micro-batch count), only the KL acts on it
                filtered += 1
                continue
            if g.credit == "turn" and not sage:
                credits = [[t.credit or 0.0 for t in tr.turns if t.role == "assistant"] for tr in trajs]
                for tr, adv in zip(trajs, turn_advantages(credits, g.advantage), strict=True):
                    out[id(tr)] = adv
            else:
                for tr, adv in zip(trajs, group_advantages(col, g.advantage), strict=True):
                    out[id(tr)] = adv
    return out, zero / max(1, n_groups), filtered / max(1, n_groups)


def _progress(t: Trajectory) -> float:
    """What an episode achieved, without the shaping terms: task success and subgoals reached."""
    return 1000.0 * t.verdict.success + len(t.verdict.subgoals_done)


def micro_batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))  # similar lengths, less padding
    return [[samples[i] for i in order[k:k + size]] for k in range(0, len(order), size)]


# ----------------------------------------------------------------------------------------------
# The phase
# ----------------------------------------------------------------------------------------------
def run(
    preset: str = "tiny",
    overrides: str = "",
    policy_model: str = "",
    world: str = "",
    tasks_dir: str = "",
    parent_run_id: str | None = None,
    model_out: str | None = None,
    checkpoint_uri: str | None = None,
) -> GRPOResult:
    cfg, home, storage_root = setup_phase(preset, overrides)  # validated before any work
    if not policy_model:
        raise ValueError("grpo: no incoming policy (policy_model) to start from — the SFT model")
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DistributedType, gather_object, set_seed
    from transformers import get_constant_schedule
    from trl.models import unwrap_model_for_generation

    from components.evaluation.evaluate import evaluate_policy, flat
    from components.sandbox.env import WorkspaceEnv
    from components.sandbox.skills import SkillLibrary
    from components.sandbox.suites import load_sandbox, world_beside

    g = cfg.grpo
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; checked before any work
    if g.tasks_per_step % world_size:
        raise ValueError(f"grpo.tasks_per_step={g.tasks_per_step} must be a multiple of the number of processes "
                         f"({world_size}): every rank rolls out the same number of groups")
    if world_size > 1 and g.async_.max_staleness:
        raise ValueError("grpo.async.max_staleness > 0 with several GRPO processes is not supported (one rollout "
                         "thread per process pair); use one process, or max_staleness=0")
    if world_size > 1 and cfg.generation.backend == "vllm":
        raise ValueError("generation.backend='vllm' with several GRPO processes is not supported (one engine per "
                         "process is not built); use 'hf', or one process with vLLM")
    world = world_beside(tasks_dir, world) or ""
    on_gpu = cfg.run.torch_device() == "cuda"
    if g.torch_threads and not on_gpu:
        from components.core.tiny import set_torch_threads

        set_torch_threads(g.torch_threads)

    # 1. checkpoints: the same place on a KFP retry (it depends on the parent run, not on this attempt)
    root = phase_root(storage_root, parent_run_id, PHASE, checkpoint_uri or g.checkpoint_uri)
    ckpts = Checkpoints(root, staging=home / "staging" / PHASE / (parent_run_id or "standalone"),
                        keep=g.keep_checkpoints, rank=rank())
    latest = ckpts.latest() if g.resume else None
    local_ckpt, state = ckpts.fetch(latest[1]) if latest else (None, {})

    with phase_run(PHASE, config=cfg, parent_run_id=parent_run_id or state.get("parent_run_id") or None,
                   close_parent=False, resume_run_id=state.get("run_id")) as tracker, contextlib.ExitStack() as closing:
        work = Path(os.environ.get("AGENTRL_GRPO_WORKDIR") or home / "runs" / tracker.run_id / PHASE)
        work.mkdir(parents=True, exist_ok=True)
        if latest:
            tracker.set_tags({"agentrl.grpo.resumed_from": str(latest[0])})

        # 2. models, optimizer, accelerate
        ds = DeepSpeedPlugin(hf_ds_config=_ds_config(g)) if g.deepspeed else None
        L = g.sage.chain_length if g.sage.enabled else 1
        per_rank = g.tasks_per_step // world_size
        ga = math.ceil(per_rank * g.group_size * L / g.micro_batch_size)  # micro-batches per optimizer step
        if ds is not None:
            ds.hf_ds_config.config["gradient_accumulation_steps"] = ga
        acc = Accelerator(cpu=not on_gpu, mixed_precision="bf16" if g.bf16 else "no", deepspeed_plugin=ds,
                          gradient_accumulation_steps=ga)
        set_seed(cfg.run.seed)
        sandbox = load_sandbox(cfg, world or None, tasks_dir or None)
        dtype = "bfloat16" if g.bf16 else "float32"
        policy = load_policy(policy_model, dtype=dtype, trainable=True, cache=home / "cache")
        if cfg.model.lora.enabled:
            policy = trainable_lora(policy, cfg.model.lora)
        ref = None
        if g.beta > 0:
            ref = load_policy(policy_model, dtype=dtype, device=str(acc.device), cache=home / "cache").model.eval()
            ref.requires_grad_(False)
        params = [p for p in policy.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=g.learning_rate, weight_decay=0.0)
        sched = get_constant_schedule(opt)
        model, opt, sched = acc.prepare(policy.model, opt, sched)
        fmt = ChatFormat(policy.tokenizer)
        correction = g.async_.active_correction(cfg.generation.backend)
        pad_id = policy.tokenizer.pad_token_id
        control_ids = control_token_ids(policy.tokenizer, cfg.sandbox.action_format)

        curriculum = Curriculum(g.curriculum)
        monitor = CollapseMonitor(g.monitor)
        start, best = 0, {"score": -math.inf, "step": -1}
        if local_ckpt is not None:
            acc.load_state(str(local_ckpt / "accelerate"))
            start = int(state["step"])
            curriculum.load_state_dict(state["curriculum"])
            monitor.load_state_dict(state["monitor"])
            best = state["best"]
        unwrapped = acc.unwrap_model(model)
        stale = g.async_.max_staleness
        # async: the rollout thread samples on its own backend (a copy of the weights); evaluation runs the learner
        backend = make_backend(cfg.generation.backend if not stale else "hf", unwrapped, policy.tokenizer,
                               cfg.generation, device=str(acc.device))
        if start:
            backend.sync(unwrapped)  # an engine starts from the weights on disk: push the resumed ones

        def log(metrics: dict[str, float], step: int) -> None:
            # a resumed run re-computes the steps after its checkpoint; MLflow already has some of them
            (tracker.log_new_metrics if latest else tracker.log_metrics)(metrics, step=step)

        def env_factory():
            # a fresh skill library per sampled chain: SAGE carries skills from task 1 to task 2 of a chain
            # (and nothing across chains, as in the paper), so the library is not training state
            return lambda: WorkspaceEnv(sandbox.world, cfg.sandbox, cfg.rewards, library=SkillLibrary())

        def evaluate_now(step: int) -> dict[str, float]:
            with unwrap_model_for_generation(model, acc):
                res = evaluate_policy(policy, cfg, sandbox, g.eval_suites, pass_k=1, max_tasks=g.eval_max_tasks,
                                      progress=False, backend=backend, chain_length=g.eval_chain_length)
            held = {f"heldout/{k}": v for k, v in flat(res["metrics"]).items()}
            held["heldout/tgc_mean"] = sum(held[f"heldout/{s}/tgc"] for s in g.eval_suites) / len(g.eval_suites)
            log(held, step)
            return held

        if start == 0:  # every rank evaluates (collective under ZeRO-3); rank 0 logs
            first = evaluate_now(0)
            best = {"score": first["heldout/tgc_mean"], "step": 0, "metrics": first}
            if g.output == "best":  # the incoming policy is a candidate too: GRPO must not hand on a worse one
                best["dir"] = str(work / "best-step-00000000")
                _save_trainable(acc, model, Path(best["dir"]))
            tracker.log_metrics({"incoming/" + k.removeprefix("heldout/"): v for k, v in first.items()}, step=0)

        # 3. the loop
        t_start = time.perf_counter()
        train = sandbox.online_tasks(g.task_pool)

        by_id = {t.id: t for t in train}

        def sample_step(k: int, on, cur: Curriculum) -> tuple[list[list[Task]], list[Trajectory]]:
            """Step k's chains (this rank's share) and their rollouts: a function of k, the curriculum's state and the
            sampling weights."""
            ch = draw_tasks(cfg, cur, train, k)
            ch = ch[acc.process_index * per_rank:(acc.process_index + 1) * per_rank]
            settings = RolloutSettings.from_config(cfg, group_size=g.group_size, temperature=g.temperature,
                                                   seed=cfg.run.seed * 1_000_003 + k + 7_919 * acc.process_index,
                                                   policy_name="grpo", progress=False)
            return ch, rollout(on, env_factory(), fmt, ch, settings, rewards=cfg.rewards)

        sampler = None
        if stale:
            from components.grpo.async_sampler import AsyncSampler

            def backend_for(copy):
                return make_backend(cfg.generation.backend, copy, policy.tokenizer, cfg.generation,
                                    device=str(acc.device))

            def produce(k: int, on, cur_state: dict) -> list[Trajectory]:
                cur = Curriculum(g.curriculum)
                cur.load_state_dict(cur_state)  # the curriculum as it was when the sampling weights were
                return sample_step(k, on, cur)[1]

            sampler = AsyncSampler(unwrapped, backend_for, produce, start, g.steps, stale,
                                   context=curriculum.state_dict(),
                                   pending=_read_pending(local_ckpt) if local_ckpt else None,
                                   threads=g.torch_threads if not on_gpu else None)
            closing.callback(sampler.close)

        tracker.set_tags({"agentrl.grpo.task_pool": f"{g.task_pool}: " + ", ".join(
            f"L{lv} {sum(t.level == lv for t in train)} ({sum(t.level == lv and t.suite == 'practice' for t in train)} "
            "unseen by SFT)" for lv in sorted({t.level for t in train}))})
        bar = tqdm(range(start, g.steps), initial=start, total=g.steps, desc="grpo", unit="step", disable=rank() != 0)
        last: dict[str, float] = {}
        step = start
        for step in bar:
            t0 = time.perf_counter()
            # a. tasks (the same on every rank, each its share) and b. rollouts (all samples of all chains, one
            # batched generation per turn) — or, async, the batch the rollout thread sampled by version step - s
            if sampler is not None:
                flat_trajs, version = sampler.batch(step)
                chains = [[t for t in (by_id[tr.task_id] for tr in flat_trajs[i:i + L])]
                          for i in range(0, len(flat_trajs), L * g.group_size)]
            else:
                model.eval()
                with unwrap_model_for_generation(model, acc):  # gathers ZeRO-3 shards for generation; else a no-op
                    chains, flat_trajs = sample_step(step, backend, curriculum)
                version = step
            samples = [flat_trajs[i:i + L] for i in range(0, len(flat_trajs), L)]  # per sampled chain
            groups = [samples[i * g.group_size:(i + 1) * g.group_size] for i in range(len(chains))]
            if g.repair.off_policy_expert:
                for chain, grp in zip(chains, groups, strict=True):
                    env = env_factory()()
                    try:
                        grp[-1] = [expert_trajectory(env, t, fmt, cfg.sandbox.action_format) for t in chain]
                    finally:
                        env.close()
            # c. rewards -> advantages
            rewards = [episode_rewards(grp, cfg) for grp in groups]
            adv, zero_var, filtered = advantages_for(groups, rewards, cfg)
            episodes = [t for grp in groups for s in grp for t in s]
            batch = [sample_from_turns(t.turns, adv[id(t)]) for t in episodes]  # a constant count: see `ga`
            # d. the update
            model.train()
            stats = update(model, ref, opt, sched, acc, batch, g, pad_id, control_ids, correction)
            backend.sync(unwrapped)  # the sampler follows the learner (vLLM: new weights or adapter)
            if acc.num_processes > 1:  # every rank sees every episode: the same curriculum, alarms and repair
                stats = _mean_over_ranks(acc, {**stats, "zero_variance_groups": zero_var, "filtered_groups": filtered})
                zero_var, filtered = stats.pop("zero_variance_groups"), stats.pop("filtered_groups")
                groups, rewards = gather_object(groups), gather_object(rewards)
                episodes = [t for grp in groups for s in grp for t in s]
            # e. monitor, curriculum, repair
            for t in episodes:
                if not t.meta.get("expert"):
                    curriculum.record(int(t.meta["level"]), t.verdict.success)
            moved = curriculum.update()
            policy_eps = [t for t in episodes if not t.meta.get("expert")]
            n_turns = sum(t.steps for t in policy_eps)
            signals = {
                "format_error_rate": sum(t.meta.get("format_errors", 0) for t in policy_eps) / max(1, n_turns),
                "entropy": stats["entropy"], "kl": stats["kl"], "zero_variance_groups": zero_var,
            }
            ratio = monitor.control_ratio(stats.get("control_prob"), stats.get("ref_control_prob"))
            if ratio is not None:
                signals["control_prob_ratio"] = ratio
            alarms = monitor.check(signals)
            repaired = 0.0
            due = g.repair.every_k_steps and (step + 1) % g.repair.every_k_steps == 0
            if (alarms and g.repair.on_alarm) or due:
                failed = [t for t in policy_eps if not t.verdict.success]
                repaired = repair(model, opt, acc, failed or policy_eps, sandbox, cfg, fmt, env_factory(), pad_id,
                                  step)
                backend.sync(unwrapped)
            if sampler is not None:  # version step+1: the weights and the curriculum after this step
                sampler.publish(step + 1, unwrapped, curriculum.state_dict())
            # f. metrics
            sols = [t.verdict.success for t in policy_eps]
            metrics = {
                "reward_mean": sum(r for rs in rewards for s in rs for r in s) / max(1, sum(len(s) for rs in rewards for s in rs)),
                "success_rate": sum(sols) / max(1, len(sols)),
                "steps_per_episode": n_turns / max(1, len(policy_eps)),
                "tokens_per_episode": sum(t.generated_tokens for t in policy_eps) / max(1, len(policy_eps)),
                "skill_reuse_rate": _skill_reuse(policy_eps),
                "curriculum/frontier": float(curriculum.frontier), "curriculum/moved": float(moved),
                **{f"curriculum/success_L{lv}": v for lv in range(1, 6)
                   if (v := curriculum.success(lv)) is not None},
                **{f"monitor/{k}": v for k, v in signals.items()},
                **{f"alarm/{a}": 1.0 for a in alarms}, "alarms": float(len(alarms)), "repair/sft_loss": repaired,
                "filtered_groups": filtered, "loss": stats["loss"], "clip_fraction": stats["clip_fraction"], "grad_norm": stats["grad_norm"],
                "trained_tokens": stats["tokens"], "learning_rate": sched.get_last_lr()[0],
                **{k: v for k, v in stats.items() if k.startswith("offpolicy/")},
                "offpolicy/staleness": float(step - version),
                "step_seconds": time.perf_counter() - t0,
            }
            if g.sage.enabled:
                metrics.update(_sage_metrics(groups))
            log(metrics, step + 1)
            last = metrics
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", success=f"{metrics['success_rate']:.2f}",
                            alarms=len(alarms))
            done = step + 1
            if g.eval_every and done % g.eval_every == 0 and done < g.steps:
                held = evaluate_now(done)
                if held["heldout/tgc_mean"] > best["score"]:
                    # one directory per best step: a resumed run trusts only the one its checkpoint names
                    best = {"score": held["heldout/tgc_mean"], "step": done, "metrics": held,
                            "dir": str(work / f"best-step-{done:08d}")}
                    _save_trainable(acc, model, Path(best["dir"]))
            if done % g.checkpoint_every == 0 or done == g.steps:
                ckpts.save(done, lambda d, n=done: _save_step_state(acc, d, sampler, n),
                           {"run_id": tracker.run_id, "parent_run_id": tracker.parent_run_id,
                            "curriculum": curriculum.state_dict(), "monitor": monitor.state_dict(),
                            "best": best}, main=acc.is_main_process, barrier=acc.wait_for_everyone)
            if g.max_minutes and _any_rank(acc, (time.perf_counter() - t_start) / 60 > g.max_minutes):
                tracker.set_tags({"agentrl.grpo.stopped": f"time budget of {g.max_minutes} min at step {done}"})
                break
        bar.close()
        steps_done = step + 1 if g.steps > start else start

        # 4. the model handed on (every rank evaluates and gathers — collective under ZeRO-3; rank 0 saves)
        final = evaluate_now(steps_done)
        out = Path(model_out) if model_out else work / "model"
        card = ModelCard(base_model=policy_model, phase=PHASE, parent_run_id=tracker.parent_run_id,
                         run_id=tracker.run_id, extra={"steps": steps_done, "sage": g.sage.enabled})
        best_dir = Path(best.get("dir") or work / "no-best")
        use_best = g.output == "best" and best_dir.exists() and best["score"] > final["heldout/tgc_mean"]
        policy.model = acc.unwrap_model(model)
        # under ZeRO-3 the module holds shards: gather the full weights to save them
        full = acc.get_state_dict(model) if acc.distributed_type == DistributedType.DEEPSPEED else None
        if use_best:
            import torch

            best_weights = torch.load(best_dir / "trainable.pt", map_location="cpu")
            if full is not None:
                full.update(best_weights)
            else:
                _load_trainable(policy.model, best_weights)
            final = best["metrics"]
        if rank() != 0:
            return None  # type: ignore[return-value]
        metrics = {**{k: float(v) for k, v in last.items()}, **final, "best_step": float(best["step"] if use_best else steps_done),
                   "world_size": float(acc.num_processes)}
        card.metrics = {k: float(v) for k, v in final.items()}
        save_policy(policy, out, card, merge=False, state_dict=full)
        log({"final/" + k.removeprefix("heldout/"): v for k, v in final.items()}, steps_done)
        uri = tracker.store_model(out, storage_root, card)
        for d in work.glob("best-step-*"):
            shutil.rmtree(d, ignore_errors=True)
        return GRPOResult(tracker.parent_run_id, tracker.run_id, str(out), uri, metrics, steps_done,
                          latest[0] if latest else None)


def run_distributed(nproc: int, **kwargs: Any) -> GRPOResult:
    """Run the phase over `nproc` processes with torchrun (one per GPU; gloo on CPU for tests)."""
    from components.core.launch import run_torchrun

    return GRPOResult(**run_torchrun("components.grpo", nproc, kwargs, "AGENTRL_GRPO_WORKDIR"))


def run_multi_node(**kwargs: Any) -> GRPOResult:
    """Run the phase as a multi-node TrainJob/PyTorchJob (grpo.multi_node) and wait for it. Its checkpoints
    live under the parent run on storage as always: a retried step launches a job that resumes."""
    from components.core.config import load_config
    from components.core.launch import run_as_job

    cfg = load_config(preset=kwargs.get("preset") or None, overrides_json=kwargs.get("overrides") or None)
    return GRPOResult(**run_as_job("components.grpo", PHASE, cfg.grpo.multi_node, cfg.storage.root, kwargs,
                                   ("policy_model", "tasks_dir"), {"world": "world.json"}))


# ----------------------------------------------------------------------------------------------
# The update, the repair, and what they report
# ----------------------------------------------------------------------------------------------
def update(model, ref, opt, sched, acc, batch: list[Sample], g, pad_id: int, control_ids: set[int],
           correction: str = "none") -> dict[str, float]:
    """`epochs_per_batch` optimizer steps over the step's episodes, accumulated over micro-batches.

    `correction` ('none', 'tis', 'mis'): importance weights for a batch another policy sampled (see
    `importance_weights`); with temperature 1 the gap between the sampler's and the learner's log-probs is
    reported either way (`offpolicy/logprob_gap`: ~1e-6 when they are one model, more when vLLM or staleness)."""
    import torch

    if not batch:
        return {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0, "tokens": 0.0}
    mbs = [collate(mb, pad_id).to(acc.device) for mb in micro_batches(batch, g.micro_batch_size)]
    if len(mbs) != acc.gradient_accumulation_steps:
        raise RuntimeError(f"grpo: {len(mbs)} micro-batches, accelerate expects {acc.gradient_accumulation_steps}")
    norm = float(sum(s.n_agent for s in batch)) if g.loss_aggregation == "token_mean" else float(len(batch))
    # the reference's log-probs; the sampling policy's (old) only when several epochs reuse the batch: with
    # one epoch the batch is on-policy and old = the current log-probs, detached (ratio 1, as TRL does)
    refs: list = [None] * len(mbs)
    olds: list = [None] * len(mbs)
    weights: list = [None] * len(mbs)
    cp = [0.0, 0.0, 0.0, 0.0]  # control-token prob: policy sum, count, reference sum, count
    with torch.no_grad():
        for i, mb in enumerate(mbs):
            if ref is not None:
                refs[i], _ = token_logprobs(ref, mb, temperature=g.temperature)
                s_, n_ = control_prob(refs[i], mb, control_ids)
                cp[2] += s_
                cp[3] += n_
            if g.epochs_per_batch > 1:
                olds[i], _ = token_logprobs(model, mb, temperature=g.temperature)
    high = g.clip_eps_high if g.clip_eps_high is not None else g.clip_eps
    totals: dict[str, float] = defaultdict(float)
    grad_norm = 0.0
    n_tokens = max(1.0, float(sum(s.n_agent for s in batch)))
    ga = acc.gradient_accumulation_steps  # = len(mbs): one optimizer step per epoch over the whole batch
    for epoch in range(g.epochs_per_batch):
        for k, (mb, old, rl) in enumerate(zip(mbs, olds, refs, strict=True)):
            with acc.accumulate(model):
                logp, ent = token_logprobs(model, mb, with_entropy=True, temperature=g.temperature)
                if epoch == 0:  # no optimizer step has happened yet: the incoming policy's control tokens
                    s_, n_ = control_prob(logp, mb, control_ids)
                    cp[0] += s_
                    cp[1] += n_
                    if g.temperature == 1.0:  # the samplers' log-probs are at temperature 1
                        weights[k], off = importance_weights(logp.detach() if old is None else old, mb, correction,
                                                             g.async_.level, g.async_.cap)
                        w_ = float(mb.mask.sum()) / n_tokens
                        for name, v in off.items():
                            totals["offpolicy/" + name] += v * w_
                loss, st = grpo_loss(logp, logp.detach() if old is None else old, rl, mb, clip_eps=g.clip_eps,
                                     clip_eps_high=high, beta=g.beta, aggregation=g.loss_aggregation, norm=norm,
                                     is_weights=weights[k])
                acc.backward(loss * ga)  # accelerate (and DeepSpeed) divide by the accumulation steps
                if acc.sync_gradients:
                    grad_norm = float(acc.clip_grad_norm_(model.parameters(), g.max_grad_norm))
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            w = float(mb.mask.sum()) / n_tokens  # this micro-batch's share of the agent tokens
            totals["loss"] += float(loss.detach())
            totals["entropy"] += float(ent) * w / g.epochs_per_batch
            for name, v in st.items():
                totals[name] += v * w / g.epochs_per_batch
    out = {"loss": totals["loss"] / g.epochs_per_batch, "clip_fraction": totals["clip_fraction"],
           "kl": totals["kl"], "entropy": totals["entropy"], "grad_norm": grad_norm,
           "tokens": float(sum(s.n_agent for s in batch) * g.epochs_per_batch),
           **{k: v for k, v in totals.items() if k.startswith("offpolicy/")}}
    if cp[1]:
        out["control_prob"] = cp[0] / cp[1]
    if cp[3]:
        out["ref_control_prob"] = cp[2] / cp[3]
    return out


def repair(model, opt, acc, failed: list[Trajectory], sandbox, cfg: PipelineConfig, fmt: ChatFormat, make_env,
           pad_id: int, step: int) -> float:
    """The alternating SFT phase: `repair.sft_steps` supervised steps on the expert's solutions of the
    tasks the policy failed (error-example supervision), at `repair.learning_rate`. Returns the mean loss."""
    by_id = {t.id: t for suite in ("train", "practice") for t in sandbox.suites.get(suite, [])}
    tasks = list({t.task_id: by_id[t.task_id] for t in failed if t.task_id in by_id}.values())
    if not tasks:
        return 0.0
    samples = []
    for task in tasks:
        env = make_env()
        try:
            traj = expert_trajectory(env, task, fmt, cfg.sandbox.action_format)
        finally:
            env.close()
        if traj.verdict.success:
            samples.append(sample_from_turns(traj.turns, 0.0))
    if not samples:
        return 0.0
    rng = random.Random(f"grpo-repair:{cfg.run.seed}:{step}")
    saved = [grp["lr"] for grp in opt.param_groups]
    for grp in opt.param_groups:
        grp["lr"] = cfg.grpo.repair.learning_rate
    model.train()
    losses = []
    try:
        for _ in range(cfg.grpo.repair.sft_steps * acc.gradient_accumulation_steps):
            with acc.accumulate(model):  # one optimizer step per `gradient_accumulation_steps` micro-batches
                mb = collate(rng.choices(samples, k=cfg.grpo.micro_batch_size), pad_id).to(acc.device)
                logp, _ = token_logprobs(model, mb)
                loss = nll_loss(logp, mb)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), cfg.grpo.max_grad_norm)
                opt.step()  # the scheduler is not stepped: repair steps are not RL steps
                opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    finally:
        for grp, lr in zip(opt.param_groups, saved, strict=True):
            grp["lr"] = lr
    return sum(losses) / len(losses)


def _skill_reuse(episodes: list[Trajectory]) -> float:
    """Episodes that called a skill from the library (defined in an earlier episode), over episodes that could."""
    later = [t for t in episodes if (t.chain_position or 0) > 0]
    pool = later or episodes
    return sum(bool(t.skills_used) for t in pool) / max(1, len(pool))


def _mean_over_ranks(acc, stats: dict[str, float]) -> dict[str, float]:
    """The update's statistics over the processes: means (over the ranks that report a key; the control-token
    probabilities are optional), trained tokens summed. Every rank then raises the same alarms."""
    from accelerate.utils import gather_object

    every = gather_object([stats])
    out = {}
    for k in sorted({k for st in every for k in st}):
        vals = [float(st[k]) for st in every if k in st]
        out[k] = sum(vals) if k == "tokens" else sum(vals) / len(vals)
    return out


def _any_rank(acc, flag: bool) -> bool:
    """True on every rank when it is true on one (the ranks stop at the same step)."""
    if acc.num_processes == 1:
        return flag
    from accelerate.utils import gather_object

    return any(gather_object([flag]))


def _sage_metrics(groups: list[list[list[Trajectory]]]) -> dict[str, float]:
    chains = [s for grp in groups for s in grp if not s[0].meta.get("expert")]
    solved_all = [all(t.verdict.success for t in ch) for ch in chains]
    second = [ch[-1] for ch in chains]
    reuse = [bool(set(ch[-1].skills_used) & {n for t in ch[:-1] for n in t.skills_defined}) for ch in chains]
    return {"sage/chain_success": sum(solved_all) / max(1, len(chains)),
            "sage/second_success": sum(t.verdict.success for t in second) / max(1, len(second)),
            "sage/skill_from_first": sum(reuse) / max(1, len(reuse))}


def _ds_config(g) -> dict[str, Any]:
    """The DeepSpeed config accelerate gets (the SFT phase's named ZeRO stages, or a JSON file)."""
    from components.sft.trainer import deepspeed_config

    conf = deepspeed_config(g.deepspeed, g.bf16)
    if isinstance(conf, str):
        import json

        conf = json.loads(Path(conf).read_text())
    conf = dict(conf)
    conf["train_micro_batch_size_per_gpu"] = g.micro_batch_size
    conf.pop("train_batch_size", None)  # DeepSpeed derives it: micro batch x accumulation x world size
    conf["gradient_clipping"] = g.max_grad_norm
    return conf


def _save_step_state(acc, d: Path, sampler, done: int) -> None:
    """A checkpoint's contents: accelerate's state, and with async the batches already sampled for the next steps."""
    acc.save_state(str(d / "accelerate"))
    if sampler is not None and acc.is_main_process:
        from components.core.schema import write_jsonl

        for k, trajs in sampler.pending(done).items():
            write_jsonl(d / "pending" / f"step-{k:08d}.jsonl", trajs)


def _read_pending(ckpt: Path) -> dict[int, list[Trajectory]]:
    from components.core.schema import read_jsonl

    return {int(f.stem.removeprefix("step-")): list(read_jsonl(f, Trajectory))
            for f in sorted((ckpt / "pending").glob("step-*.jsonl"))}


def _save_trainable(acc, model, d: Path) -> None:
    """The trainable tensors only (a LoRA adapter, or every weight of a full fine-tune); gathered under ZeRO-3."""
    import torch
    from accelerate.utils import DistributedType

    d.mkdir(parents=True, exist_ok=True)
    unwrapped = acc.unwrap_model(model)
    names = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
    if acc.distributed_type == DistributedType.DEEPSPEED:
        state = {n: t for n, t in acc.get_state_dict(model).items() if n in names}
    else:
        state = {n: p.detach().cpu().clone() for n, p in unwrapped.named_parameters() if n in names}
    if acc.is_main_process:
        torch.save(state, d / "trainable.pt")


def _load_trainable(model, state: dict) -> None:
    import torch

    params = dict(model.named_parameters())
    missing = set(state) - set(params)
    if missing:
        raise RuntimeError(f"grpo: the best checkpoint holds tensors the model lacks: {sorted(missing)[:3]}")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)
