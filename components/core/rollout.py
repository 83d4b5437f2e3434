"""Multi-turn agent rollouts over many environments at once.

Written by hand: no library runs multi-turn, token-exact agent episodes with per-turn environment
feedback, groups and skill-carrying chains. Every turn, all live episodes advance together with one
batched generation (grouped only by how much room each has left). An episode stops when the agent
finishes, at `max_turns`, at its token budget, or when its context is full; every stop other than
the agent's own is flagged on the Trajectory (`truncated`, `finish_reason`), never silent.

Groups and chains: each chain of tasks (length 1 for plain rollouts) is sampled `group_size` times;
one sample is a "slot" that owns one environment for the whole chain, so episode j of a chain starts
with the skill library that episode j-1 of the same sample left (SAGE's sequential rollout).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from components.core.config import RewardConfig
from components.core.generation import GenerationBackend, SamplingParams
from components.core.rewards import score, turn_credit
from components.core.schema import RewardBreakdown, Task, Trajectory, Turn, Verdict
from components.core.tokens import ChatFormat
from components.core.tokens import Sequence as TokSeq

__all__ = ["Group", "RolloutSettings", "regroup", "rollout", "rollout_groups"]


@dataclass
class RolloutSettings:
    group_size: int = 1
    max_turns: int = 8
    max_new_tokens: int = 96
    max_context_tokens: int = 1024
    token_budget: int | None = None  # generated tokens per episode
    temperature: float = 1.0
    top_p: float = 1.0
    max_live: int = 64  # environments alive at once
    seed: int = 0
    policy_name: str = "policy"
    progress: bool = True

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> RolloutSettings:
        """Turns, token limits, batch and top_p from a PipelineConfig; sampling at its temperature unless overridden."""
        g = cfg.generation
        base = dict(max_turns=cfg.sandbox.max_turns, max_new_tokens=g.max_new_tokens,
                    max_context_tokens=g.max_context_tokens, max_live=g.batch_size, top_p=g.top_p,
                    temperature=max(g.temperature, 1e-3), seed=cfg.run.seed)
        return cls(**{**base, **overrides})


@dataclass
class Group:
    """One chain of tasks (one task for plain rollouts) and its `group_size` samples: each sample is the chain's
    episodes in order. GRPO normalises rewards within a group, per chain position."""

    chain: list[Task]
    samples: list[list[Trajectory]]

    def episodes(self) -> list[Trajectory]:
        return [t for s in self.samples for t in s]


@dataclass
class _Episode:
    slot: _Slot
    task: Task
    position: int
    seq: TokSeq = field(default_factory=TokSeq)
    turns: list[Turn] = field(default_factory=list)
    n_turns: int = 0
    generated: int = 0
    finish_reason: str = ""
    truncated: bool = False
    key: int = 0  # names the episode to the backend (its KV cache between turns)


@dataclass
class _Slot:
    chain: list[Task]
    sample: int
    chain_id: str
    env: Any = None
    next: int = 0
    out: list[Trajectory] = field(default_factory=list)


def rollout(
    backend: GenerationBackend,
    env_factory: Callable[[], Any],
    fmt: ChatFormat,
    tasks: Sequence[Task] | Sequence[Sequence[Task]],
    settings: RolloutSettings | None = None,
    rewards: RewardConfig | None = None,
    reward_fn: Callable[[Trajectory, Verdict], Any] | None = None,
    chain_reward: Callable[[list[Trajectory]], list[RewardBreakdown]] | None = None,
) -> list[Trajectory]:
    """Run every task (or chain of tasks) `group_size` times; returns Trajectories ordered by chain, then sample,
    then position in the chain (`rollout_groups` returns them as groups).

    `env_factory()` makes a fresh Environment (with its own skill library); it is called once per slot.
    Rewards: `reward_fn(traj, verdict)` per episode (default: the reward table, `core.rewards.score`); then, when a
    sample's chain is complete, `chain_reward(episodes)` may replace them with rewards of the whole chain (SAGE's
    skill-integrated reward: task 1's reward depends on whether task 2 reused its skill).
    """
    s = settings or RolloutSettings()
    rewards = rewards or RewardConfig()
    chains = [list(t) if isinstance(t, (list, tuple)) else [t] for t in tasks]
    slots = [_Slot(chain, g, uuid.uuid4().hex[:12]) for chain in chains for g in range(s.group_size)]
    total = sum(len(sl.chain) for sl in slots)
    bar = tqdm(total=total, desc="rollout", unit="ep", disable=not s.progress, mininterval=1.0)
    pending = list(slots)
    live: list[_Episode] = []
    turn_no = 0
    keys = iter(range(1, 1 << 62))

    def start(slot: _Slot) -> None:
        if slot.env is None:
            slot.env = env_factory()
        task = slot.chain[slot.next]
        first = slot.env.reset(task)
        system = getattr(slot.env, "system_prompt", "")
        tools = list(getattr(slot.env, "tools", None) or [])  # JSON schemas: the template's `tools=` or the system text
        ep = _Episode(slot, task, slot.next, key=next(keys))
        ids = fmt.prompt_ids(system, first, tools)
        ep.seq.extend(ids, generated=False)
        ep.turns += [Turn("system", system, tokens=[], mask=[], info={"tools": tools} if tools else {}),
                     Turn("user", first, tokens=ids, mask=[0] * len(ids))]
        slot.next += 1
        live.append(ep)

    def finish(ep: _Episode) -> None:
        backend.end_sessions([ep.key])
        env = ep.slot.env
        verdict = env.verify()
        info = env.episode_info() if hasattr(env, "episode_info") else {}
        traj = Trajectory(
            task_id=ep.task.id, policy=s.policy_name, turns=ep.turns, verdict=verdict,
            reward=RewardBreakdown(0.0, {}), steps=ep.n_turns, generated_tokens=ep.generated,
            skills_defined=list(info.get("skills_defined", [])), skills_used=list(info.get("skills_used", [])),
            chain_id=ep.slot.chain_id if len(ep.slot.chain) > 1 else None,
            chain_position=ep.position if len(ep.slot.chain) > 1 else None,
            truncated=ep.truncated, finish_reason=ep.finish_reason or "finish",
            meta={"scenario_id": ep.task.scenario_id, "level": ep.task.level, "suite": ep.task.suite,
                  "sample": ep.slot.sample, "format_errors": info.get("format_errors", 0)},
        )
        traj.reward = reward_fn(traj, verdict) if reward_fn else score(traj, verdict, rewards, max_turns=s.max_turns)
        for turn, c in zip([t for t in traj.turns if t.role == "assistant"], turn_credit(traj, verdict, rewards),
                           strict=True):
            turn.credit = c
        ep.slot.out.append(traj)
        bar.update()
        if chain_reward is not None and len(ep.slot.out) == len(ep.slot.chain):
            for t, r in zip(ep.slot.out, chain_reward(ep.slot.out), strict=True):
                t.reward = r
        if ep.slot.next < len(ep.slot.chain):
            start(ep.slot)
        else:
            if hasattr(ep.slot.env, "close"):
                ep.slot.env.close()
            ep.slot.env = None

    def fill() -> None:
        active_slots = {id(e.slot) for e in live}
        while pending and len(active_slots) < s.max_live:
            slot = pending.pop(0)
            active_slots.add(id(slot))
            start(slot)

    try:
        fill()
        while live:
            # room left per episode: context and token budget
            groups: dict[int, list[_Episode]] = {}
            for ep in list(live):
                room = min(s.max_new_tokens, s.max_context_tokens - len(ep.seq) - 1)
                if s.token_budget is not None:
                    room = min(room, s.token_budget - ep.generated)
                if room <= 0:
                    ep.truncated, ep.finish_reason = True, ("token_budget" if s.token_budget is not None and
                                                            ep.generated >= s.token_budget else "context")
                    live.remove(ep)
                    finish(ep)
                    continue
                groups.setdefault(room, []).append(ep)
            for room, eps in sorted(groups.items()):
                params = SamplingParams(s.temperature, s.top_p, room, seed=s.seed * 100_003 + turn_no)
                outs = backend.generate([ep.seq.ids for ep in eps], params, sessions=[ep.key for ep in eps])
                for ep, out in zip(eps, outs, strict=True):
                    _advance(ep, out, fmt, s)
                    if ep.finish_reason:
                        live.remove(ep)
                        finish(ep)
            turn_no += 1
            fill()
    finally:
        bar.close()
        backend.end_sessions()  # nothing cached outlives the call: the weights may change before the next
        for sl in slots:
            if sl.env is not None and hasattr(sl.env, "close"):
                sl.env.close()
    return [t for sl in slots for t in sl.out]


def rollout_groups(backend: GenerationBackend, env_factory: Callable[[], Any], fmt: ChatFormat,
                   tasks: Sequence[Task] | Sequence[Sequence[Task]], settings: RolloutSettings | None = None,
                   **rewards: Any) -> list[Group]:
    """`rollout`, returned as one Group per chain (`rewards`: rollout's reward keyword arguments)."""
    s = settings or RolloutSettings()
    chains = [list(t) if isinstance(t, (list, tuple)) else [t] for t in tasks]
    return regroup(rollout(backend, env_factory, fmt, chains, s, **rewards), chains, s.group_size)


def regroup(trajs: Sequence[Trajectory], chains: Sequence[Sequence[Task]], group_size: int) -> list[Group]:
    """Trajectories in `rollout`'s order (chain, sample, position) as groups."""
    out, k = [], 0
    for chain in chains:
        n = len(chain)
        out.append(Group(list(chain), [list(trajs[k + i * n:k + (i + 1) * n]) for i in range(group_size)]))
        k += n * group_size
    if k != len(trajs):
        raise ValueError(f"regroup: {len(trajs)} trajectories for {len(chains)} chains x {group_size} samples")
    return out


def _advance(ep: _Episode, out, fmt: ChatFormat, s: RolloutSettings) -> None:
    """Append one generated turn, step the environment, append the observation."""
    ep.seq.extend(out.ids, generated=True, logprobs=out.logprobs)
    ep.generated += len(out.ids)
    ep.n_turns += 1
    text = fmt.decode_action(out.ids)
    ep.turns.append(Turn("assistant", text, tokens=list(out.ids), mask=[1] * len(out.ids), logprobs=list(out.logprobs),
                         info={} if out.ended_with_eos else {"cut": True}))
    res = ep.slot.env.step(text)
    role = getattr(res, "role", "tool")  # 'user': the user speaks mid-episode
    glue = fmt.glue_ids(res.observation, out.ended_with_eos, role)
    ep.turns.append(Turn(role, res.observation, observation=res.observation, step_reward=res.step_reward,
                         tokens=glue, mask=[0] * len(glue), info=dict(res.info)))
    if res.done:
        ep.finish_reason = "finish" if not res.info.get("truncated") else str(res.info["truncated"])
        ep.truncated = bool(res.info.get("truncated"))
    elif ep.n_turns >= s.max_turns:
        ep.finish_reason, ep.truncated = "max_turns", True
    elif len(ep.seq) + len(glue) + 1 >= s.max_context_tokens:
        ep.finish_reason, ep.truncated = "context", True
    if not ep.finish_reason:
        ep.seq.extend(glue, generated=False)
