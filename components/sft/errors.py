"""Error-example supervision (STaR-style rationalisation): a plausible failed first attempt, the
environment's answer to it, then the expert's correct turns. The failed attempt sits in the prompt
(no loss), the correction is the completion: the model learns to recover from the errors a small
policy actually makes (a tool name that does not exist, a missing argument, broken JSON)."""

from __future__ import annotations

import json
import random
from typing import Any

from components.core.env import LoadedEnvironment
from components.core.schema import Task, Trajectory
from components.core.tokens import messages


def mistakes(first_action: str, rng: random.Random) -> str:
    """A wrong version of the expert's first action."""
    thought, _, body = first_action.partition("\n")
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return thought + "\n" + body[: max(1, len(body) // 2)]  # cut code
    kind = rng.randrange(3)
    if kind == 0:  # a tool that does not exist
        app, _, op = call["tool"].partition(".")
        call["tool"] = f"{app}.{op}s" if op else call["tool"] + "s"
        return thought + "\n" + json.dumps(call)
    if kind == 1 and call.get("args"):  # a missing argument
        call["args"].pop(sorted(call["args"])[0])
        return thought + "\n" + json.dumps(call)
    return thought + "\n" + json.dumps(call)[:-2]  # broken JSON


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
