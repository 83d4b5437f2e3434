"""Rewards -> advantages for groups of multi-turn episodes.

Written by hand: TRL's GRPO advantages are one number per completion; here a sample is an episode
(or a chain of episodes) whose agent turns may each get their own advantage (turn-level credit).

A *group* is the G samples of one task (or of one chain position, for SAGE chains). Estimators:
- `grpo`:   (r - mean) / (std + eps)                       (Shao et al., 2024)
- `drgrpo`: r - mean, no std division                       (Dr. GRPO, Liu et al., 2025)
- `rloo`:   r - mean of the other G-1 samples               (Ahmadian et al., 2024)
"""

from __future__ import annotations

from collections.abc import Sequence

EPS = 1e-6


def group_advantages(rewards: Sequence[float], kind: str = "grpo") -> list[float]:
    """Advantages of one group's rewards."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    if kind == "grpo":
        std = (sum((r - mean) ** 2 for r in rewards) / max(1, n - 1)) ** 0.5  # unbiased, as TRL
        return [(r - mean) / (std + EPS) for r in rewards]
    if kind == "drgrpo":
        return [r - mean for r in rewards]
    if kind == "rloo":
        if n == 1:
            return [0.0]
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    raise ValueError(f"grpo.advantage: unknown estimator {kind!r} (expected grpo | drgrpo | rloo)")


def zero_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """A group whose samples all scored the same teaches nothing (its advantages are all 0)."""
    return len(rewards) < 2 or max(rewards) - min(rewards) <= tol


def returns_to_go(credits: Sequence[float]) -> list[float]:
    """Turn k's return: the credit of turn k and every later turn of the episode."""
    out, acc = [], 0.0
    for c in reversed(credits):
        acc += c
        out.append(acc)
    return out[::-1]


def turn_advantages(group_credits: Sequence[Sequence[float]], kind: str = "grpo") -> list[list[float]]:
    """Turn-level advantages for one group: each turn's return-to-go, normalised over every turn of the group.

    Returns one list per episode, one advantage per agent turn.
    """
    rtg = [returns_to_go(c) for c in group_credits]
    flat = [r for ep in rtg for r in ep]
    if not flat:
        return [[] for _ in group_credits]
    if kind == "rloo":  # leave-one-episode-out baseline: the mean return of the other episodes' turns
        out = []
        for i, ep in enumerate(rtg):
            others = [r for j, e in enumerate(rtg) if j != i for r in e]
            base = sum(others) / len(others) if others else 0.0
            out.append([r - base for r in ep])
        return out
    mean = sum(flat) / len(flat)
    if kind == "drgrpo":
        return [[r - mean for r in ep] for ep in rtg]
    if kind != "grpo":
        raise ValueError(f"grpo.advantage: unknown estimator {kind!r} (expected grpo | drgrpo | rloo)")
    std = (sum((r - mean) ** 2 for r in flat) / max(1, len(flat) - 1)) ** 0.5
    return [[(r - mean) / (std + EPS) for r in ep] for ep in rtg]
