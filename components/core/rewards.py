"""Rewards: the trajectory's total as a sum of weighted components, per-turn credit, and SAGE's skill reward.

Components (weights from `RewardConfig`, the seed's reward table):
- task:    `task_success` if the verifier says solved;
- subgoal: `subgoal` (+0.2) per subgoal reached (the information-quality part of the seed's table);
- efficiency: `efficiency` x (1 - steps / max_turns) on a solved task;
- skill: SAGE's skill-integrated bonus, set by chain rollouts (`sage_rewards`), else 0;
- the environment's step shaping, split by kind: api (success/error/recovery/repeat/clarification),
  format (malformed actions), safety (hard refusals and soft penalties), other (another name it gives), step (its
  `step_reward` when it names no parts; present only then).
Per-turn credit (seed 000, hierarchical decomposition): R(t) = R_subgoal(t) + gamma^(T-t) R_terminal + r(t),
where a failed episode's negative terminal reward lands only on the turns of the first subgoal it
failed (after the last subgoal it reached).
"""

from __future__ import annotations

from collections.abc import Sequence

from components.core.config import RewardConfig
from components.core.schema import RewardBreakdown, Trajectory, Verdict

API = {"api_success", "api_error", "error_recovery", "repeat_action", "clarification"}
FORMAT = {"format_error"}


def _kind(part: str) -> str:
    if part in API:
        return "api"
    if part in FORMAT:
        return "format"
    if part == "hard_violation" or part.startswith("soft_"):
        return "safety"
    if part == "step":  # an environment's unnamed step reward
        return "step"
    return "other"


def agent_turn_indices(traj: Trajectory) -> list[int]:
    return [i for i, t in enumerate(traj.turns) if t.role == "assistant"]


def step_parts(traj: Trajectory) -> list[dict[str, float]]:
    """The environment's reward parts for each agent turn, from the observation (a tool or user turn) that follows
    it: its named `reward_parts`, else its `step_reward` as the part `step`."""
    out = []
    for i in agent_turn_indices(traj):
        nxt = traj.turns[i + 1] if i + 1 < len(traj.turns) else None
        if nxt is None or nxt.role not in ("tool", "user"):
            out.append({})
        elif "reward_parts" in nxt.info:
            out.append(dict(nxt.info["reward_parts"]))
        else:
            out.append({"step": nxt.step_reward} if nxt.step_reward else {})
    return out


def score(traj: Trajectory, verdict: Verdict, cfg: RewardConfig | None = None, max_turns: int = 12,
          skill: float = 0.0) -> RewardBreakdown:
    cfg = cfg or RewardConfig()
    steps = len(agent_turn_indices(traj))
    comps = {"task": cfg.task_success if verdict.success else 0.0,
             "subgoal": cfg.subgoal * len(verdict.subgoals_done),
             "efficiency": cfg.efficiency * max(0.0, 1.0 - steps / max_turns) if verdict.success else 0.0,
             "skill": skill, "api": 0.0, "format": 0.0, "safety": 0.0, "other": 0.0}
    for parts in step_parts(traj):
        for k, v in parts.items():
            comps[_kind(k)] = comps.get(_kind(k), 0.0) + v
    comps = {k: round(v, 6) for k, v in comps.items()}
    return RewardBreakdown(round(sum(comps.values()), 6), comps)


def turn_credit(traj: Trajectory, verdict: Verdict, cfg: RewardConfig | None = None) -> list[float]:
    """Credit for each agent turn (same order as the assistant turns)."""
    cfg = cfg or RewardConfig()
    idx = agent_turn_indices(traj)
    T = len(idx)
    if T == 0:
        return []
    parts = step_parts(traj)
    reached_at: list[int] = []
    for i in idx:
        nxt = traj.turns[i + 1] if i + 1 < len(traj.turns) else None
        reached_at.append(len(nxt.info.get("subgoals_done", [])) if nxt is not None else 0)
    last_progress = max((k for k in range(T) if reached_at[k]), default=-1)
    gamma = cfg.terminal_discount
    credit = []
    for k in range(T):
        r = cfg.subgoal * reached_at[k] + sum(parts[k].values())
        if verdict.success:
            r += gamma ** (T - 1 - k) * cfg.task_success
        elif k > last_progress:  # the span of the first subgoal that was not reached
            r += -(gamma ** (T - 1 - k)) * cfg.task_success
        credit.append(round(r, 6))
    return credit


def sage_rewards(chain: Sequence[Trajectory], code_form: bool = True) -> list[float]:
    """SAGE's skill-integrated reward for a chain of two tasks of one scenario.

    R1 = 1[t1 solved] + 1[t1 solved and t2 solved and t2 used a skill from t1]
    R2 = 1[t2 solved] + 1[t2 solved and t2 used a skill from t1]
    In code form a reply without code scores -1.
    """
    if len(chain) != 2:
        raise ValueError(f"SAGE's reward is defined for chains of two tasks, got {len(chain)}")
    t1, t2 = chain
    s1, s2 = t1.verdict.success, t2.verdict.success
    used = bool(set(t2.skills_used) & set(t1.skills_defined))
    r1 = float(s1) + float(s1 and s2 and used)
    r2 = float(s2) + float(s2 and used)
    if code_form:
        r1 = -1.0 if not _has_code(t1) else r1
        r2 = -1.0 if not _has_code(t2) else r2
    return [r1, r2]


def _has_code(traj: Trajectory) -> bool:
    return any(t.role == "assistant" and "```" in t.text for t in traj.turns)
