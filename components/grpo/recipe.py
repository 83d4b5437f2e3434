"""GRPO for multi-turn agents, top to bottom (one readable recipe, torchtune-style).

The loop is written here on `accelerate` (one code path: one CPU process, or data parallel over the GPUs
of a pod or of several nodes, with DeepSpeed ZeRO when configured) instead of TRL's GRPOTrainer: its unit is a chain of multi-turn episodes with
observations between agent turns and per-turn advantages, which single-completion trainers cannot
express. `make bench` holds it against TRL on the single-turn case (`grpo.throughput_vs_trl`).

1. `run`: resolve the config (validated before any work); `GRPORecipe` finds the latest complete checkpoint.
2. `setup`: open the phase's MLflow run (the same run again when resuming); load the environment (`core.env`), the
   policy, the reference (SFT) model when beta > 0, the optimizer; restore everything from the checkpoint.
3. `step`, every step:
   a. draw tasks by the curriculum (chains of two tasks of one scenario with SAGE) from `grpo.task_pool`: by
      default the environment's practice suite, instances no SFT demo shows (a success there needs what
      generalises, not a memorised demo), the train suite's tasks at a level it lacks;
   b. `rollout`: `group_size` samples of each chain, returned as groups (the runtime's batched multi-turn loop),
      optionally with one sample per group replaced by the expert's solution (off-policy supervision);
   c. rewards, set by the rollout (the reward table, or SAGE's skill-integrated reward through its chain-reward
      hook) -> group advantages (trajectory- or turn-level), carried on the training samples;
   d. clipped surrogate + k3 KL on agent tokens, `epochs_per_batch` optimizer steps;
   e. the collapse monitor; on an alarm (or every K steps) a short SFT repair on expert solutions of
      the tasks the policy failed;
   f. metrics to MLflow; then `after_step`: every `eval_every` steps the validation tasks (`validate`: tasks of the
      pool withheld from training, `split_validation`) choose the best model, so the held-out suites are never
      chosen on (`grpo.select_on=heldout` chooses on them instead); with `eval_chain_length` 2 as chains of two
      tasks of one scenario, so skill reuse is measured; a checkpoint every `checkpoint_every` steps; the time budget.
4. `finish`: save the best (or last) policy as the phase's Model artifact, with its held-out numbers (`evaluate`,
   measured on the incoming model at step 0 and on the handed-on one here).

Several processes (`launch`: torchrun over a multi-GPU pod, or a TrainJob with `grpo.multi_node`): every
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Unpack

from tqdm import tqdm

from components.core.checkpoint import Checkpoints
from components.core.config import PipelineConfig, load_config
from components.core.env import LoadedEnvironment, by_family, interleave_families
from components.core.evaluate import evaluate_policy, flat, greedy_rollouts, suite_metrics
from components.core.generation import make_backend
from components.core.phase import PhaseContext, PhaseResult, Places
from components.core.phase import launch as launch_phase
from components.core.policy import load_policy, save_policy
from components.core.recovery import recovery_examples
from components.core.rewards import sage_rewards
from components.core.rollout import Group, RolloutSettings, regroup, rollout_groups
from components.core.schema import RewardBreakdown, Task, Trajectory, Turn
from components.core.tokens import ChatFormat, encode_messages, messages
from components.core.tracking import rank
from components.core.training import deepspeed_config, gpus
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


def _candidates(tasks: list[Task]) -> list[Task]:
    """A quarter of each scenario family's tasks (their order kept; families of fewer than 4 count as one), in turns
    of the families: the first k of them spread over the families."""
    fams = list(by_family(tasks).values())
    small = [t for ts in fams if len(ts) < 4 for t in ts]
    return interleave_families([t for ts in [*(ts for ts in fams if len(ts) >= 4), small] for t in ts[:len(ts) // 4]])


def split_validation(tasks: list[Task], n: int) -> tuple[list[Task], list[Task]]:
    """(train, validation) of the task pool: `n` tasks withheld from training to choose the best model on, spread
    evenly over the levels and, within a level, over its scenario families, at most a quarter of any family's (a
    level of fewer than 4 gives none). The same split for every run seed, so the seeds of one
    configuration are chosen on the same tasks."""
    rng = random.Random("grpo-validation")
    by: dict[int, list[Task]] = defaultdict(list)
    for t in sorted(tasks, key=lambda t: t.id):
        by[t.level].append(t)
    for lv in sorted(by):
        rng.shuffle(by[lv])
        by[lv] = _candidates(by[lv])
    cap = {lv: len(ts) for lv, ts in by.items()}
    take = dict.fromkeys(by, 0)
    while sum(take.values()) < n and any(take[lv] < cap[lv] for lv in by):
        for lv in sorted(by):
            if take[lv] < cap[lv] and sum(take.values()) < n:
                take[lv] += 1
    held = {t.id for lv, ts in by.items() for t in ts[:take[lv]]}
    return [t for t in tasks if t.id not in held], [t for t in tasks if t.id in held]


def expert_trajectory(env, task: Task, fmt: ChatFormat, expert: Any) -> Trajectory | None:
    """The environment's expert solution (`expert(env, task)`), tokenised the way the policy sees it (agent mask
    from the template); None when the environment has none."""
    traj = expert(env, task)  # with the skills it defined and used
    if traj is None:
        return None
    ids, mask = encode_messages(fmt.tok, messages(traj))
    # one synthetic "turn" carries the whole conversation: its advantage applies to every agent token
    traj.turns = [Turn("assistant", "", tokens=ids, mask=mask)]
    traj.meta = {**traj.meta, "expert": True, "format_errors": 0}
    return traj


def chain_reward_for(cfg: PipelineConfig) -> Callable[[list[Trajectory]], list[RewardBreakdown]] | None:
    """The rollout's chain-reward hook: SAGE's skill-integrated reward for chains of two tasks; else None (each
    episode keeps the reward table's reward)."""
    if not (cfg.grpo.sage.enabled and cfg.grpo.sage.chain_length == 2):
        return None
    code_form = cfg.sandbox.action_format == "code"
    return lambda chain: [RewardBreakdown(r, {"sage": r}) for r in sage_rewards(chain, code_form=code_form)]


def advantages_for(groups: list[Group], cfg: PipelineConfig) -> tuple[list[Sample], float, float]:
    """The training samples of the groups' episodes, each carrying its advantage (one for the whole episode, or one
    per agent turn with turn credit); + the fractions of groups with zero reward variance and of groups
    `grpo.group_filter` left without advantage.

    Each chain position is normalised within its group (the G samples of one chain), on `reward.total`.
    """
    g = cfg.grpo
    sage = g.sage.enabled and g.sage.chain_length == 2  # SAGE's reward: no shaping terms, skill reuse counts
    samples: list[Sample] = []
    zero = filtered = n_groups = 0
    for grp in groups:
        adv: list[list[Any]] = [[0.0] * len(s) for s in grp.samples]  # [sample][position]
        for pos in range(len(grp.chain)):
            trajs = [s[pos] for s in grp.samples]
            col = [t.reward.total for t in trajs]
            n_groups += 1
            zero += zero_variance(col)
            if g.group_filter == "progress" and not sage and zero_variance([_progress(t) for t in trajs]):
                filtered += 1  # still in the batch (a constant micro-batch count), only the KL acts on it
                continue
            if g.credit == "turn" and not sage:
                credits = [[t.credit or 0.0 for t in tr.turns if t.role == "assistant"] for tr in trajs]
                col_adv = turn_advantages(credits, g.advantage)
            else:
                col_adv = group_advantages(col, g.advantage)
            for i, a in enumerate(col_adv):
                adv[i][pos] = a
        samples += [sample_from_turns(t.turns, adv[i][pos]) for i, s in enumerate(grp.samples)
                    for pos, t in enumerate(s)]
    return samples, zero / max(1, n_groups), filtered / max(1, n_groups)


def _progress(t: Trajectory) -> float:
    """What an episode achieved, without the shaping terms: task success and subgoals reached."""
    return 1000.0 * t.verdict.success + len(t.verdict.subgoals_done)


def micro_batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))  # similar lengths, less padding
    return [[samples[i] for i in order[k:k + size]] for k in range(0, len(order), size)]


# ----------------------------------------------------------------------------------------------
# The phase
# ----------------------------------------------------------------------------------------------
def run(preset: str = "tiny", overrides: str = "", policy_model: str = "", checkpoint_uri: str | None = None,
        **places: Unpack[Places]) -> PhaseResult:
    ctx = PhaseContext.setup(PHASE, preset, overrides, incoming=policy_model, **places)  # validated before any work
    recipe = GRPORecipe(ctx, policy_model, checkpoint_uri)
    with ctx.open(resume=recipe.state), contextlib.ExitStack() as closing:
        recipe.setup(closing)
        for step in recipe.bar:
            recipe.step(step)
            if recipe.after_step(step + 1):
                break
        return recipe.finish()


def launch(processes: int | None = None, **kwargs: Any) -> PhaseResult:
    """The phase as its config asks: a multi-node TrainJob (grpo.multi_node; its checkpoints live under the parent run
    as always, so a retried step launches a job that resumes), one process per GPU of the pod under torchrun (HF
    generation; `processes`: default, the GPUs this pod sees), or this process (with vLLM generation: one process, one
    engine, one GPU)."""
    cfg = load_config(preset=kwargs.get("preset") or None, overrides_json=kwargs.get("overrides") or None)
    n = (gpus() if processes is None else processes) if cfg.generation.backend == "hf" else 1
    return launch_phase("components.grpo", run, kwargs, cfg.grpo.multi_node, n, ("policy_model", "tasks_dir"),
                        {"world": "world.json"}, cfg.storage.root)


class GRPORecipe:
    """The GRPO loop as named steps: `setup` (models, optimizer, accelerate, checkpoint, first evaluation), `step` (one
    RL step: tasks, rollouts, advantages, update, monitor and repair, metrics), `evaluate` (held-out), `after_step`
    (best model, checkpoint, time budget), `finish` (the model handed on)."""

    def __init__(self, ctx: PhaseContext, policy_model: str, checkpoint_uri: str | None = None) -> None:
        self.ctx, self.cfg, self.g = ctx, ctx.cfg, ctx.cfg.grpo
        self.policy_model = policy_model
        g = self.g
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; checked before any work
        if g.tasks_per_step % self.world_size:
            raise ValueError(f"grpo.tasks_per_step={g.tasks_per_step} must be a multiple of the number of processes "
                             f"({self.world_size}): every rank rolls out the same number of groups")
        if self.world_size > 1 and g.async_.max_staleness:
            raise ValueError("grpo.async.max_staleness > 0 with several GRPO processes is not supported (one rollout "
                             "thread per process pair); use one process, or max_staleness=0")
        if self.world_size > 1 and self.cfg.generation.backend == "vllm":
            raise ValueError("generation.backend='vllm' with several GRPO processes is not supported (one engine per "
                             "process is not built); use 'hf', or one process with vLLM")
        self.on_gpu = self.cfg.run.torch_device() == "cuda"
        ctx.use_threads(g.torch_threads)
        # 1. checkpoints: the same place on a KFP retry (it depends on the parent run, not on this attempt)
        self.ckpts = Checkpoints(ctx.checkpoint_root(checkpoint_uri or g.checkpoint_uri), staging=ctx.staging(),
                                 keep=g.keep_checkpoints, rank=rank())
        self.latest = self.ckpts.latest() if g.resume else None
        self.local_ckpt, self.state = self.ckpts.fetch(self.latest[1]) if self.latest else (None, {})
        self.L = g.sage.chain_length if g.sage.enabled else 1  # episodes per sampled chain
        self.per_rank = g.tasks_per_step // self.world_size
        self.chain_reward = chain_reward_for(self.cfg)

    # ------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------
    def setup(self, closing: contextlib.ExitStack) -> None:
        """2. The environment, the policy, the reference, the optimizer, accelerate; everything a checkpoint restores;
        the generation backend (and the async sampler); the incoming policy's held-out numbers."""
        import torch
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, set_seed
        from transformers import get_constant_schedule

        ctx, cfg, g = self.ctx, self.cfg, self.g
        self.tracker = ctx.tracker
        if self.latest:
            self.tracker.set_tags({"agentrl.grpo.resumed_from": str(self.latest[0])})
        ds = DeepSpeedPlugin(hf_ds_config=_ds_config(g)) if g.deepspeed else None
        ga = math.ceil(self.per_rank * g.group_size * self.L / g.micro_batch_size)  # micro-batches per optimizer step
        if ds is not None:
            ds.hf_ds_config.config["gradient_accumulation_steps"] = ga
        self.acc = acc = Accelerator(cpu=not self.on_gpu, mixed_precision="bf16" if g.bf16 else "no",
                                     deepspeed_plugin=ds, gradient_accumulation_steps=ga)
        set_seed(cfg.run.seed)
        self.env = ctx.environment()
        dtype = "bfloat16" if g.bf16 else "float32"
        self.policy = policy = ctx.load_policy(self.policy_model, bf16=g.bf16)
        self.ref = None
        if g.beta > 0:
            self.ref = load_policy(self.policy_model, dtype=dtype, device=str(acc.device),
                                   cache=ctx.home / "cache").model.eval()
            self.ref.requires_grad_(False)
        params = [p for p in policy.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=g.learning_rate, weight_decay=0.0)
        self.model, self.opt, self.sched = acc.prepare(policy.model, opt, get_constant_schedule(opt))
        self.fmt = ChatFormat(policy.tokenizer)
        self.correction = g.async_.active_correction(cfg.generation.backend)
        self.pad_id = policy.tokenizer.pad_token_id
        self.control_ids = control_token_ids(policy.tokenizer, cfg.sandbox.action_format)
        self.curriculum = Curriculum(g.curriculum)
        self.monitor = CollapseMonitor(g.monitor)
        self.start, self.best = 0, {"score": -math.inf, "step": -1}
        if self.local_ckpt is not None:
            acc.load_state(str(self.local_ckpt / "accelerate"))
            self.start = int(self.state["step"])
            self.curriculum.load_state_dict(self.state["curriculum"])
            self.monitor.load_state_dict(self.state["monitor"])
            self.best = self.state["best"]
        self.unwrapped = acc.unwrap_model(self.model)
        stale = g.async_.max_staleness
        # async: the rollout thread samples on its own backend (a copy of the weights); evaluation runs the learner
        self.backend = make_backend(cfg.generation.backend if not stale else "hf", self.unwrapped, policy.tokenizer,
                                    cfg.generation, device=str(acc.device))
        if self.start:
            self.backend.sync(self.unwrapped)  # an engine starts from the weights on disk: push the resumed ones

        pool = self.env.online_tasks(g.task_pool)
        self.train, self.validation = (split_validation(pool, g.validation_tasks) if g.select_on == "validation"
                                       else (pool, []))
        train = self.train
        if g.select_on == "validation" and not self.validation:
            raise ValueError(f"grpo.select_on='validation': the task pool {g.task_pool!r} has no level with 4 or more "
                             f"tasks ({len(pool)} tasks) to withhold validation tasks from; set grpo.select_on='heldout'")
        if self.start == 0:  # every rank evaluates (collective under ZeRO-3); rank 0 logs
            first = self.evaluate(0)
            self.tracker.log_metrics({"incoming/" + k.removeprefix("heldout/"): v for k, v in first.items()}, step=0)
            self.best = {"score": self.score(0, first), "step": 0}
            if g.output == "best":  # the incoming policy is a candidate too: GRPO must not hand on a worse one
                self.best["dir"] = str(ctx.work / "best-step-00000000")
                _save_trainable(acc, self.model, Path(self.best["dir"]))

        self.t_start = time.perf_counter()
        self.by_id = {t.id: t for t in train}
        self.sampler = None
        if stale:
            from components.grpo.async_sampler import AsyncSampler

            def backend_for(copy):
                return make_backend(cfg.generation.backend, copy, policy.tokenizer, cfg.generation,
                                    device=str(acc.device))

            def produce(k: int, on, cur_state: dict) -> list[Trajectory]:
                cur = Curriculum(g.curriculum)
                cur.load_state_dict(cur_state)  # the curriculum as it was when the sampling weights were
                return [t for grp in self.rollout(k, on, cur) for t in grp.episodes()]

            self.sampler = AsyncSampler(self.unwrapped, backend_for, produce, self.start, g.steps, stale,
                                        context=self.curriculum.state_dict(),
                                        pending=_read_pending(self.local_ckpt) if self.local_ckpt else None,
                                        threads=g.torch_threads if not self.on_gpu else None)
            closing.callback(self.sampler.close)
        self.tracker.set_tags({"agentrl.grpo.task_pool": f"{g.task_pool}: " + ", ".join(
            f"L{lv} {sum(t.level == lv for t in train)} ({sum(t.level == lv and t.suite == 'practice' for t in train)} "
            "unseen by SFT)" for lv in sorted({t.level for t in train}))})
        self.bar = tqdm(range(self.start, g.steps), initial=self.start, total=g.steps, desc="grpo", unit="step",
                        disable=rank() != 0)
        self.last: dict[str, float] = {}
        self.steps_done = self.start

    def log(self, metrics: dict[str, float], step: int) -> None:
        # a resumed run re-computes the steps after its checkpoint; MLflow already has some of them
        (self.tracker.log_new_metrics if self.latest else self.tracker.log_metrics)(metrics, step=step)

    # ------------------------------------------------------------------------------------------
    # one step
    # ------------------------------------------------------------------------------------------
    def rollout(self, k: int, backend: Any, curriculum: Curriculum) -> list[Group]:
        """Step k's groups (this rank's share of its chains): a function of k, the curriculum's state and the
        sampling weights."""
        g, acc = self.g, self.acc
        chains = draw_tasks(self.cfg, curriculum, self.train, k)
        chains = chains[acc.process_index * self.per_rank:(acc.process_index + 1) * self.per_rank]
        settings = RolloutSettings.from_config(self.cfg, group_size=g.group_size, temperature=g.temperature,
                                               seed=self.cfg.run.seed * 1_000_003 + k + 7_919 * acc.process_index,
                                               policy_name="grpo", progress=False)
        # a fresh environment (and skill library) per sampled chain: SAGE carries skills from task 1 to task 2 of a
        # chain, nothing across chains, so the library is not training state
        return rollout_groups(backend, self.env.factory(), self.fmt, chains, settings, rewards=self.cfg.rewards,
                              chain_reward=self.chain_reward)

    def step(self, step: int) -> dict[str, float]:
        """3. One RL step."""
        from accelerate.utils import gather_object
        from trl.models import unwrap_model_for_generation

        g, acc, model = self.g, self.acc, self.model
        t0 = time.perf_counter()
        # a. tasks (the same on every rank, each its share) and b. rollouts (all samples of all chains, one batched
        # generation per turn) — or, async, the batch the rollout thread sampled by version step - s
        if self.sampler is not None:
            flat_trajs, version = self.sampler.batch(step)
            chains = [[self.by_id[t.task_id] for t in flat_trajs[i:i + self.L]]
                      for i in range(0, len(flat_trajs), self.L * g.group_size)]
            groups = regroup(flat_trajs, chains, g.group_size)
        else:
            model.eval()
            with unwrap_model_for_generation(model, acc):  # gathers ZeRO-3 shards for generation; else a no-op
                groups = self.rollout(step, self.backend, self.curriculum)
            version = step
        if g.repair.off_policy_expert:  # one sample per group replaced by the expert's solution
            for grp in groups:
                env = self.env.factory()()
                try:
                    expert = [expert_trajectory(env, t, self.fmt, self.env.expert) for t in grp.chain]
                finally:
                    env.close()
                if any(t is None for t in expert):  # the environment has no solution for one of these tasks
                    continue
                if self.chain_reward is not None:
                    for t, r in zip(expert, self.chain_reward(expert), strict=True):
                        t.reward = r
                grp.samples[-1] = expert
        # c. rewards (set by the rollout) -> advantages, carried on the samples
        batch, zero_var, filtered = advantages_for(groups, self.cfg)  # a constant count: see `ga`
        # d. the update
        model.train()
        stats = update(model, self.ref, self.opt, self.sched, acc, batch, g, self.pad_id, self.control_ids,
                       self.correction)
        self.backend.sync(self.unwrapped)  # the sampler follows the learner (vLLM: new weights or adapter)
        if acc.num_processes > 1:  # every rank sees every episode: the same curriculum, alarms and repair
            stats = _mean_over_ranks(acc, {**stats, "zero_variance_groups": zero_var, "filtered_groups": filtered})
            zero_var, filtered = stats.pop("zero_variance_groups"), stats.pop("filtered_groups")
            groups = gather_object(groups)
        episodes = [t for grp in groups for t in grp.episodes()]
        # e. monitor, curriculum, repair
        for t in episodes:
            if not t.meta.get("expert"):
                self.curriculum.record(int(t.meta["level"]), t.verdict.success)
        moved = self.curriculum.update()
        policy_eps = [t for t in episodes if not t.meta.get("expert")]
        n_turns = sum(t.steps for t in policy_eps)
        signals = {
            "format_error_rate": sum(t.meta.get("format_errors", 0) for t in policy_eps) / max(1, n_turns),
            "entropy": stats["entropy"], "kl": stats["kl"], "zero_variance_groups": zero_var,
        }
        ratio = self.monitor.control_ratio(stats.get("control_prob"), stats.get("ref_control_prob"))
        if ratio is not None:
            signals["control_prob_ratio"] = ratio
        alarms = self.monitor.check(signals)
        repaired, recovered = 0.0, 0
        due = g.repair.every_k_steps and (step + 1) % g.repair.every_k_steps == 0
        if (alarms and g.repair.on_alarm) or due:
            failed = [t for t in policy_eps if not t.verdict.success]
            repaired, recovered = repair(model, self.opt, acc, failed or policy_eps, self.env, self.cfg, self.fmt,
                                         self.pad_id, step)
            self.backend.sync(self.unwrapped)
        if self.sampler is not None:  # version step+1: the weights and the curriculum after this step
            self.sampler.publish(step + 1, self.unwrapped, self.curriculum.state_dict())
        # f. metrics
        sols = [t.verdict.success for t in policy_eps]
        metrics = {
            "reward_mean": sum(t.reward.total for t in episodes) / max(1, len(episodes)),
            "success_rate": sum(sols) / max(1, len(sols)),
            "steps_per_episode": n_turns / max(1, len(policy_eps)),
            "tokens_per_episode": sum(t.generated_tokens for t in policy_eps) / max(1, len(policy_eps)),
            "skill_reuse_rate": _skill_reuse(policy_eps),
            "curriculum/frontier": float(self.curriculum.frontier), "curriculum/moved": float(moved),
            **{f"curriculum/success_L{lv}": v for lv in range(1, 6)
               if (v := self.curriculum.success(lv)) is not None},
            **{f"monitor/{k}": v for k, v in signals.items()},
            **{f"alarm/{a}": 1.0 for a in alarms}, "alarms": float(len(alarms)), "repair/sft_loss": repaired,
            "repair/recovery_examples": float(recovered),
            "filtered_groups": filtered, "loss": stats["loss"], "clip_fraction": stats["clip_fraction"],
            "grad_norm": stats["grad_norm"], "trained_tokens": stats["tokens"],
            "learning_rate": self.sched.get_last_lr()[0],
            **{k: v for k, v in stats.items() if k.startswith("offpolicy/")},
            "offpolicy/staleness": float(step - version),
            "step_seconds": time.perf_counter() - t0,
        }
        if g.sage.enabled:
            metrics.update(_sage_metrics(groups))
        self.log(metrics, step + 1)
        self.last = metrics
        self.bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", success=f"{metrics['success_rate']:.2f}",
                             alarms=len(alarms))
        return metrics

    def validate(self, step: int) -> dict[str, float]:
        """Greedy metrics of the learner on the validation tasks (withheld from training; every rank, rank 0 logs)."""
        from trl.models import unwrap_model_for_generation

        with unwrap_model_for_generation(self.model, self.acc):
            trajs = greedy_rollouts(self.backend, self.env.factory(), self.fmt, self.cfg, self.validation,
                                    self.g.eval_chain_length)
        val = {f"val/{k}": v["value"] for k, v in suite_metrics(trajs, n_boot=0).items()}
        self.log(val, step)
        return val

    def score(self, step: int, held: dict[str, float] | None = None) -> float:
        """What the best model is chosen by: validation TGC, or (`select_on=heldout`) the held-out TGC mean (`held`,
        when this step's held-out evaluation has run)."""
        if self.g.select_on == "validation":
            return self.validate(step)["val/tgc"]
        return (held or self.evaluate(step))["heldout/tgc_mean"]

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out greedy metrics of the learner (every rank: collective under ZeRO-3; rank 0 logs)."""
        from trl.models import unwrap_model_for_generation

        g = self.g
        with unwrap_model_for_generation(self.model, self.acc):
            res = evaluate_policy(self.policy, self.cfg, self.env, g.eval_suites, pass_k=1, max_tasks=g.eval_max_tasks,
                                  progress=False, backend=self.backend, chain_length=g.eval_chain_length)
        held = {f"heldout/{k}": v for k, v in flat(res["metrics"]).items()}
        measured = list(res["metrics"])  # the configured suites the environment has (else its held-out ones)
        held["heldout/tgc_mean"] = sum(held[f"heldout/{s}/tgc"] for s in measured) / len(measured)
        self.log(held, step)
        return held

    def after_step(self, done: int) -> bool:
        """The periodic evaluation (validation, or held-out; the best model kept), a checkpoint, the time budget;
        True to stop."""
        g, acc = self.g, self.acc
        self.steps_done = done
        if g.eval_every and done % g.eval_every == 0 and done < g.steps:
            score = self.score(done)
            if score > self.best["score"]:
                # one directory per best step: a resumed run trusts only the one its checkpoint names
                self.best = {"score": score, "step": done, "dir": str(self.ctx.work / f"best-step-{done:08d}")}
                _save_trainable(acc, self.model, Path(self.best["dir"]))
        if done % g.checkpoint_every == 0 or done == g.steps:
            self.ckpts.save(done, lambda d, n=done: _save_step_state(acc, d, self.sampler, n),
                            {"run_id": self.tracker.run_id, "parent_run_id": self.tracker.parent_run_id,
                             "curriculum": self.curriculum.state_dict(), "monitor": self.monitor.state_dict(),
                             "best": self.best}, main=acc.is_main_process, barrier=acc.wait_for_everyone)
        if g.max_minutes and _any_rank(acc, (time.perf_counter() - self.t_start) / 60 > g.max_minutes):
            self.tracker.set_tags({"agentrl.grpo.stopped": f"time budget of {g.max_minutes} min at step {done}"})
            return True
        return False

    # ------------------------------------------------------------------------------------------
    # finish
    # ------------------------------------------------------------------------------------------
    def finish(self) -> PhaseResult:
        """4. The model handed on: the best (when `grpo.output=best` and it beats the last) or the last. Every rank
        evaluates and gathers (collective under ZeRO-3); rank 0 saves and stores."""
        from accelerate.utils import DistributedType

        ctx, g, acc, model, best = self.ctx, self.g, self.acc, self.model, self.best
        self.bar.close()
        steps_done = self.steps_done
        held = self.evaluate(steps_done) if g.select_on == "heldout" else None
        out = ctx.out
        card = ctx.card(self.policy_model, steps=steps_done, sage=g.sage.enabled)
        best_dir = Path(best.get("dir") or ctx.work / "no-best")
        use_best = g.output == "best" and best_dir.exists() and best["score"] > self.score(steps_done, held)
        self.policy.model = acc.unwrap_model(model)
        on_deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
        if use_best:
            import torch

            _load_trainable(self.policy.model, torch.load(best_dir / "trainable.pt", map_location="cpu"),
                            sharded=on_deepspeed)
            held = None
        # the handed-on model's held-out numbers: measured once, after the choice (never chosen on, by default)
        final = held or self.evaluate(steps_done)
        # under ZeRO-3 the module holds shards: gather the full weights to save them
        full = acc.get_state_dict(model) if on_deepspeed else None
        if rank() != 0:
            return None  # type: ignore[return-value]
        metrics = {**{k: float(v) for k, v in self.last.items()}, **final,
                   "best_step": float(best["step"] if use_best else steps_done), "world_size": float(acc.num_processes)}
        card.metrics = {k: float(v) for k, v in final.items()}
        save_policy(self.policy, out, card, merge=False, state_dict=full)
        self.log({"final/" + k.removeprefix("heldout/"): v for k, v in final.items()}, steps_done)
        res = ctx.finish(out, card, metrics, steps_done=steps_done,
                         resumed_from=self.latest[0] if self.latest else None)
        for d in ctx.work.glob("best-step-*"):
            shutil.rmtree(d, ignore_errors=True)
        return res


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


def repair(model, opt, acc, failed: list[Trajectory], env: LoadedEnvironment, cfg: PipelineConfig, fmt: ChatFormat,
           pad_id: int, step: int) -> tuple[float, int]:
    """The alternating SFT phase: `repair.sft_steps` supervised steps on the expert's solutions of the
    tasks the policy failed and (`repair.recovery_ratio`) recovery examples made from them, at
    `repair.learning_rate`. Returns the mean loss and the number of recovery examples."""
    by_id = {t.id: t for suite in ("train", "practice") for t in env.suites.get(suite, [])}
    tasks = list({t.task_id: by_id[t.task_id] for t in failed if t.task_id in by_id}.values())
    if not tasks:
        return 0.0, 0
    samples, solved = [], []
    make_env = env.factory()
    for task in tasks:
        episode = make_env()
        try:
            traj = env.expert(episode, task)
        finally:
            episode.close()
        if traj is not None and traj.verdict.success:
            solved.append(traj)
    # the solutions, and (recovery supervision) an error at some turn of them, its refusal, the corrected turns
    for traj in solved:
        ids, mask = encode_messages(fmt.tok, messages(traj))
        samples.append(Sample(ids, mask, [0.0] * len(ids), [math.nan] * len(ids)))
    recovery = recovery_examples(solved, env, cfg.run.seed + step, cfg.grpo.repair.recovery_ratio,
                                 suites=("train", "practice"))
    for ex in recovery:
        ids, mask = fmt.encode_conversation(ex["prompt"] + ex["completion"], len(ex["prompt"]))
        samples.append(Sample(ids, mask, [0.0] * len(ids), [math.nan] * len(ids)))
    if not samples:
        return 0.0, 0
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
    return sum(losses) / len(losses), len(recovery)


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


def _sage_metrics(groups: list[Group]) -> dict[str, float]:
    chains = [s for grp in groups for s in grp.samples if not s[0].meta.get("expert")]
    solved_all = [all(t.verdict.success for t in ch) for ch in chains]
    second = [ch[-1] for ch in chains]
    reuse = [bool(set(ch[-1].skills_used) & {n for t in ch[:-1] for n in t.skills_defined}) for ch in chains]
    return {"sage/chain_success": sum(solved_all) / max(1, len(chains)),
            "sage/second_success": sum(t.verdict.success for t in second) / max(1, len(second)),
            "sage/skill_from_first": sum(reuse) / max(1, len(reuse))}


def _ds_config(g) -> dict[str, Any]:
    """The DeepSpeed config accelerate gets (the shared named ZeRO stages, or a JSON file)."""
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
        # every rank joins the gather; under ZeRO-3 only the main process gets the tensors back (None elsewhere)
        state = {n: t for n, t in (acc.get_state_dict(model) or {}).items() if n in names}
    else:
        state = {n: p.detach().cpu().clone() for n, p in unwrapped.named_parameters() if n in names}
    if rank() == 0:  # the launcher's rank: accelerate's is_main_process is not reliable under DeepSpeed on CPU
        torch.save(state, d / "trainable.pt")


def _load_trainable(model, state: dict, sharded: bool = False) -> None:
    """`state` (from `_save_trainable`) into `model`; `sharded`: under DeepSpeed, the ZeRO-3 shards are gathered for
    the copy and partitioned again after it (a no-op for the unpartitioned parameters of ZeRO-1/2)."""
    import torch

    params = dict(model.named_parameters())
    missing = set(state) - set(params)
    if missing:
        raise RuntimeError(f"grpo: the best checkpoint holds tensors the model lacks: {sorted(missing)[:3]}")
    gather = contextlib.nullcontext()
    if sharded:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters([params[n] for n in state], modifier_rank=0)
    with gather, torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t.to(params[n].dtype))
