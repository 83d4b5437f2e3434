"""Recovery supervision (the seed's supervised repair, at any turn), shared by SFT and GRPO's collapse repair.

An expert demo is replayed to a turn k; a wrong version of turn k — an id or a name miscopied (the API's 404/403),
or a format error (a tool that does not exist, a missing argument, broken JSON) — is sent, and the environment's
refusal recorded; then the expert's turns from k on. The demo's earlier turns and the mistake sit in the prompt (no
loss); the corrected turns are the completion: the model learns to read an error and repair its action, the
failure a small policy meets far into a long episode. Only a mistake that the environment refuses (`"ok":false`),
after which the expert's turns are answered exactly as in the demo and still solve the task (verified), is kept.

Hand-written: which mistakes a small policy makes, and replaying an episode to the turn where one is made, are
this environment's, not any library's.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from components.core.env import LoadedEnvironment
from components.core.schema import Task, Trajectory
from components.core.tokens import messages

__all__ = ["miscopy", "mistakes", "recovery_examples"]

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


_ID = re.compile(r"^([A-Za-z_-]*?)(\d+)$")
_NAME = re.compile(r"^[a-z][a-z.@-]{2,}$")


def miscopy(action: str, rng: random.Random) -> str | None:
    """The action with one id or name argument miscopied (a digit changed, a letter dropped or doubled), as a small
    model copies from far back; None when it has no such argument."""
    thought, _, body = action.partition("\n")
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    args = call.get("args")
    if not isinstance(args, dict):
        return None
    # (container, key) of every id or name: an argument, or an item of a list argument ("ids": ["m12", "m40"])
    spots = [(c, k) for c, keys in [(args, sorted(args))] + [(v, range(len(v))) for _, v in sorted(args.items())
                                                            if isinstance(v, list)]
             for k in keys if isinstance(c[k], str) and (_ID.match(c[k]) or _NAME.match(c[k]))]
    if not spots:
        return None
    container, key = rng.choice(spots)
    value = container[key]
    m = _ID.match(value)
    if m:
        digits = m.group(2)
        i = rng.randrange(len(digits))
        new = str((int(digits[i]) + rng.randrange(1, 10)) % 10)
        container[key] = m.group(1) + digits[:i] + new + digits[i + 1:]
    else:
        i = rng.randrange(1, len(value))
        container[key] = value[:i] + value[i + 1:] if rng.random() < 0.5 else value[:i] + value[i] + value[i:]
    return thought + "\n" + json.dumps(call)


def _same(res: Any, msgs: list[dict[str, Any]], i: int) -> bool:
    """The environment answered agent turn `i` as the demo records (and the episode goes on where the demo does)."""
    nxt = msgs[i + 1] if i + 1 < len(msgs) else None
    return nxt is not None and res.observation == nxt["content"] and (not res.done or i + 2 >= len(msgs))


def recovery_examples(trajs: list[Trajectory], env: LoadedEnvironment, seed: int, ratio: float,
                      suites: tuple[str, ...] = ("train",)) -> list[dict[str, Any]]:
    """About `ratio` x len(trajs) recovery examples: demos drawn at random, a turn k of each drawn at random, a
    miscopied id or name there (a format error when the action has none), kept when the environment refuses it."""
    tasks: dict[str, Task] = {t.id: t for s in suites for t in env.suites.get(s, [])}
    usable = [t for t in trajs if t.task_id in tasks and t.verdict.success
              and not any("```" in x.text for x in t.turns if x.role == "assistant")]
    want = round(ratio * len(trajs))
    if not usable or want <= 0:
        return []
    rng = random.Random(f"recovery:{seed}")
    episode = env.factory()()
    out: list[dict[str, Any]] = []
    try:
        for _ in range(4 * want):  # tries: a mistake the environment accepts is dropped
            if len(out) >= want:
                break
            traj = rng.choice(usable)
            msgs = messages(traj)
            agent = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            k = rng.choice(agent)
            wrong = miscopy(msgs[k]["content"], rng) or mistakes(msgs[k]["content"], rng)
            if wrong == msgs[k]["content"]:
                continue
            episode.reset(tasks[traj.task_id])
            # the state before turn k: the demo replayed, each answer the demo's own
            if not all(_same(episode.step(msgs[i]["content"]), msgs, i) for i in agent if i < k):
                continue
            res = episode.step(wrong)
            if '"ok":false' not in res.observation or res.done:
                continue  # the mistake must fail without changing anything...
            # ...so that the expert's turns from k on are answered as in the demo and still solve the task (a
            # miscopied id of another user's data is refused, yet it is a hard violation: such a mistake is dropped)
            if not all(_same(episode.step(msgs[i]["content"]), msgs, i) for i in agent if i >= k):
                continue
            if not episode.verify().success:
                continue
            out.append({"prompt": msgs[:k] + [{"role": "assistant", "content": wrong},
                                              {"role": res.role, "content": res.observation}],
                        "completion": msgs[k:]})
    finally:
        episode.close()
    return out
