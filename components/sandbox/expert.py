"""The expert solver and the reward-hacking probes, both acting through the agent's action interface.

The expert replays a task's reference solution as the agent would write it — JSON tool calls, or
code that defines the scenario's skill in its first task and calls it from the library later — and
retries throttled or failed calls like a careful agent. The probes are policies that must never
verify: do nothing, say "done", act on the wrong items, create an empty artifact.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from components.core.schema import RewardBreakdown, Task, Trajectory, Turn, Verdict
from components.sandbox.workspace import WorkspaceEnv

RETRYABLE = (429, 503)


def render_json(thought: str, tool: str, args: dict[str, Any]) -> str:
    return f"Thought: {thought}\n" + json.dumps({"tool": tool, "args": args}, ensure_ascii=False)


def render_code(thought: str, code: str) -> str:
    return f"Thought: {thought}\n```python\n{code.strip()}\n```"


def _subst(value: Any, mem: dict[str, str]) -> Any:
    if isinstance(value, str):
        for k, v in mem.items():
            value = value.replace(k, v)
        return value
    if isinstance(value, list):
        return [_subst(v, mem) for v in value]
    if isinstance(value, dict):
        return {k: _subst(v, mem) for k, v in value.items()}
    return value


class Recorder:
    """Runs actions on an env and records the episode as a Trajectory."""

    def __init__(self, env: WorkspaceEnv, task: Task, policy_name: str) -> None:
        self.env, self.task, self.policy = env, task, policy_name
        first = env.reset(task)
        tools = env.tools
        self.turns = [Turn("system", env.system_prompt, info={"tools": tools} if tools else {}), Turn("user", first)]
        self.parts: dict[str, float] = {}
        self.last: dict[str, Any] = {}

    def act(self, text: str) -> dict[str, Any]:
        res = self.env.step(text)
        self.turns.append(Turn("assistant", text))
        self.turns.append(Turn("tool", res.observation, observation=res.observation, step_reward=res.step_reward,
                               info=dict(res.info)))
        for k, v in res.info.get("reward_parts", {}).items():
            self.parts[k] = round(self.parts.get(k, 0.0) + v, 6)
        self.last = json.loads(res.observation) if res.observation.startswith("{") and "(truncated)" not in res.observation else {}
        self.last["_done"] = res.done
        return self.last

    @property
    def done(self) -> bool:
        return bool(self.last.get("_done"))

    def finish(self) -> tuple[Trajectory, Verdict]:
        verdict = self.env.verify()
        info = self.env.episode_info()
        parts = dict(self.parts)
        parts["task_success"] = self.env.rewards.task_success if verdict.success else 0.0
        parts["subgoal"] = round(self.env.rewards.subgoal * len(verdict.subgoals_done), 6)
        traj = Trajectory(
            task_id=self.task.id, policy=self.policy, turns=self.turns, verdict=verdict,
            reward=RewardBreakdown(round(sum(parts.values()), 6), parts), steps=info["steps"],
            generated_tokens=0, skills_defined=info["skills_defined"], skills_used=info["skills_used"],
            truncated=not info["finished"], finish_reason="finish" if info["finished"] else "max_turns",
            meta={"scenario_id": self.task.scenario_id, "level": self.task.level, "suite": self.task.suite},
        )
        return traj, verdict


def _error_code(obs: dict[str, Any]) -> int | None:
    err = obs.get("error")
    if isinstance(err, dict):
        return err.get("code")
    if isinstance(err, str) and err.startswith("ApiError "):
        try:
            return int(err.split()[1].rstrip(":"))
        except (IndexError, ValueError):
            return None
    return None


def _replay(rec: Recorder, steps: list[dict[str, Any]], transform=None, retries: int = 5) -> None:
    """Act out solution steps, substituting `$draft`/`$id` from earlier results; retry throttled calls."""
    mem: dict[str, str] = {}
    for step in steps:
        args = _subst(step["args"], mem)
        if transform is not None:
            args = transform(args)
        for _attempt in range(retries + 1):
            obs = rec.act(render_json(step["thought"], step["tool"], args))
            if _error_code(obs) not in RETRYABLE:
                break
        result = obs.get("result")
        if isinstance(result, dict):
            for key in ("draft", "id"):
                if isinstance(result.get(key), str):
                    mem["$" + key] = result[key]
        if rec.done:
            break


def solve_json(env: WorkspaceEnv, task: Task, policy: str = "expert-json") -> tuple[Trajectory, Verdict]:
    rec = Recorder(env, task, policy)
    _replay(rec, task.solution["steps"])
    return rec.finish()


def solve_code(env: WorkspaceEnv, task: Task, policy: str = "expert-code") -> tuple[Trajectory, Verdict]:
    rec = Recorder(env, task, policy)
    skill = task.solution["skill"]
    have = {s.name for s in env.retrieved}
    code = skill["call"]
    if skill["source"] and skill["name"] not in have:
        code = skill["source"] + "\n\n" + code
        thought = f"I will write a reusable function {skill['name']} and use it."
    else:
        thought = f"I will use the skill {skill['name']}." if skill["source"] else "This request must be refused."
    if "apis.finish" not in code:
        code += "\napis.finish()"
    for _attempt in range(4):
        obs = rec.act(render_code(thought, code))
        if rec.done or _error_code(obs) not in RETRYABLE:
            break
    if not rec.done:
        rec.act(render_json("The task is complete.", "finish", {}))
    return rec.finish()


# ----------------------------------------------------------------------------------------------
# Reward-hacking probes: each must fail every task.
# ----------------------------------------------------------------------------------------------
def probe_do_nothing(env: WorkspaceEnv, task: Task):
    rec = Recorder(env, task, "probe-do-nothing")
    rec.act(render_json("Nothing to do.", "finish", {}))
    return rec.finish()


def probe_say_done(env: WorkspaceEnv, task: Task):
    rec = Recorder(env, task, "probe-say-done")
    rec.act(render_json("Done.", "finish", {"answer": "done, all taken care of"}))
    return rec.finish()


def _perturb(args: dict[str, Any], env: WorkspaceEnv, task: Task) -> dict[str, Any]:
    a = copy.deepcopy(args)
    w = env.base_world
    own = [m["id"] for m in w.mail.values() if m["owner"] == task.user_id]
    if isinstance(a.get("ids"), list):
        a["ids"] = [x for x in own if x not in a["ids"]][: max(1, len(a["ids"]))]
    if "id" in a and isinstance(a["id"], str) and a["id"].startswith("m"):
        a["id"] = next(x for x in own if x != a["id"])
    if isinstance(a.get("day"), int):
        a["day"] = a["day"] % 5 + 1
    if isinstance(a.get("channel"), str):
        chans = [c["name"] for c in w.channels.values() if task.user_id in c["members"] and c["name"] != a["channel"]]
        if chans:
            a["channel"] = chans[0]
    if isinstance(a.get("content"), str):
        a["content"] = a["content"] + "\n0"
    if isinstance(a.get("answer"), str) and a["answer"]:
        a["answer"] = "0" if a["answer"] != "0" else "1"
    if isinstance(a.get("to"), list):
        a["to"] = ["kim@ext.com" if t != "kim@ext.com" else "sam@ext.com" for t in a["to"]]
    return a


def probe_wrong_items(env: WorkspaceEnv, task: Task):
    rec = Recorder(env, task, "probe-wrong-items")
    if all(s["tool"] in ("finish", "ask_user") for s in task.solution["steps"]):
        # nothing to act on (a refusal): act on one of the user's own items instead
        own = next(m["id"] for m in env.base_world.mail.values() if m["owner"] == task.user_id and m["folder"] != "Archive")
        rec.act(render_json("I will tidy up first.", "mail.move", {"ids": [own], "folder": "Archive"}))
    _replay(rec, task.solution["steps"], transform=lambda a: _perturb(a, env, task), retries=0)
    if not rec.done:
        rec.act(render_json("Done.", "finish", {}))
    return rec.finish()


def probe_empty_artifact(env: WorkspaceEnv, task: Task):
    rec = Recorder(env, task, "probe-empty-artifact")
    rec.act(render_json("I will create the result file.", "files.create", {"name": "result.txt", "content": ""}))
    rec.act(render_json("I will add the event.", "calendar.create", {"title": "", "day": 1, "start": 9}))
    rec.act(render_json("Done.", "finish", {}))
    return rec.finish()


PROBES: dict[str, Callable[[WorkspaceEnv, Task], tuple[Trajectory, Verdict]]] = {
    "do_nothing": probe_do_nothing,
    "say_done": probe_say_done,
    "wrong_items": probe_wrong_items,
    "empty_artifact": probe_empty_artifact,
}
