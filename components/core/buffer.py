"""A trajectory buffer: success filtering, efficiency ranking and diversity (dedup by action sequence).

Used by rejection sampling (keep the best distinct successes per task) and by DPO (best vs worst of a group).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections import defaultdict
from collections.abc import Iterable

from components.core.schema import Trajectory


def action_text(traj: Trajectory) -> str:
    """The agent's actions, normalised (JSON re-serialised, whitespace folded), one per line."""
    parts = []
    for t in traj.turns:
        if t.role != "assistant":
            continue
        text = t.text
        start = text.find("{")
        if "```" in text:
            body = text[text.index("```"):]
            parts.append(" ".join(body.split()))
            continue
        try:
            parts.append(json.dumps(json.loads(text[start:]), sort_keys=True))
        except (ValueError, json.JSONDecodeError):
            parts.append(" ".join(text.split()))
    return "\n".join(parts)


def action_signature(traj: Trajectory) -> str:
    return hashlib.sha256(action_text(traj).encode()).hexdigest()


def near_duplicate(a: str, b: str, threshold: float) -> bool:
    """True when the two action texts are at least `threshold` similar (difflib ratio; 1.0 = identical only)."""
    if a == b:
        return True
    if threshold >= 1.0:
        return False
    m = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return m.real_quick_ratio() >= threshold and m.quick_ratio() >= threshold and m.ratio() >= threshold


def efficiency_key(traj: Trajectory) -> tuple:
    """Best first: solved, higher reward, fewer steps, fewer generated tokens."""
    return (not traj.verdict.success, -traj.reward.total, traj.steps, traj.generated_tokens)


class TrajectoryBuffer:
    def __init__(self, trajectories: Iterable[Trajectory] = ()) -> None:
        self.items: list[Trajectory] = list(trajectories)

    def add(self, trajs: Iterable[Trajectory]) -> None:
        self.items.extend(trajs)

    def by_task(self) -> dict[str, list[Trajectory]]:
        out: dict[str, list[Trajectory]] = defaultdict(list)
        for t in self.items:
            out[t.task_id].append(t)
        return dict(out)

    def successes(self) -> list[Trajectory]:
        return [t for t in self.items if t.verdict.success and not any(v.startswith("hard:") for v in t.verdict.violations)]

    def success_rate(self) -> dict[str, float]:
        return {k: sum(t.verdict.success for t in v) / len(v) for k, v in self.by_task().items()}

    def top_k(self, k: int, successful_only: bool = True, similarity: float = 1.0) -> dict[str, list[Trajectory]]:
        """Per task: the k best distinct trajectories (no two whose action sequences are `similarity`-alike)."""
        out = {}
        for task, trajs in self.by_task().items():
            cands = sorted((t for t in trajs if t.verdict.success or not successful_only), key=efficiency_key)
            kept_text: list[str] = []
            keep: list[Trajectory] = []
            for t in cands:
                text = action_text(t)
                if any(near_duplicate(text, other, similarity) for other in kept_text):
                    continue
                kept_text.append(text)
                keep.append(t)
                if len(keep) == k:
                    break
            if keep:
                out[task] = keep
        return out

    def best_and_worst(self) -> dict[str, tuple[Trajectory, Trajectory]]:
        """Per task with distinct outcomes: (best, worst) by efficiency_key — AgentQ-style preference pairs."""
        out = {}
        for task, trajs in self.by_task().items():
            ranked = sorted(trajs, key=efficiency_key)
            if len(ranked) >= 2 and efficiency_key(ranked[0])[:2] != efficiency_key(ranked[-1])[:2]:
                out[task] = (ranked[0], ranked[-1])
        return out
