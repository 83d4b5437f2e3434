"""Error-example supervision (STaR-style rationalisation): a plausible failed first attempt, the
environment's answer to it, then the expert's correct turns. The failed attempt sits in the prompt
(no loss), the correction is the completion. Recovery at any turn, with miscopied ids and names, is
`core.recovery` (shared with GRPO's repair)."""

from __future__ import annotations

import random
from typing import Any

from components.core.env import LoadedEnvironment
from components.core.recovery import mistakes
from components.core.schema import Task, Trajectory
from components.core.tokens import messages


def error_examples(trajs: list[Trajectory], env: LoadedEnvironment, seed: int) -> list[dict[str, Any]]:
    """One error example per demo whose first action can be broken so that it fails without changing anything."""
    tasks: dict[str, Task] = {t.id: t for t in env.suites["train"]}
    episode = env.factory()()
    rng = random.Random(seed)
    out = []
    try:
        for traj in trajs:
            task = tasks.get(traj.task_id)
            first = next((t.text for t in traj.turns if t.role == "assistant"), None)
            if task is None or first is None or "```" in first:
                continue
            episode.reset(task)
            wrong = mistakes(first, rng)
            res = episode.step(wrong)
            if '"ok":false' not in res.observation:
                continue  # the mistake must fail without changing anything
            good = messages(traj)
            prompt = good[:2] + [{"role": "assistant", "content": wrong}, {"role": "tool", "content": res.observation}]
            out.append({"prompt": prompt, "completion": good[2:]})
    finally:
        episode.close()
    return out
