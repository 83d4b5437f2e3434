"""An environment defined entirely by files: a user brings tasks and tools without touching agentrl's code.

A folder holds

    env.json      {"name": ..., "system_prompt": ..., "max_turns": 8, "heldout": ["easy", "hard"],
                   "rewards": {"tool_error": -0.05, "format_error": -0.1}}
    tools.json    the tools as JSON schemas (OpenAI's function format), what the model is shown
    tools.py      one function per tool, `name(state, **arguments) -> JSON`, over an in-memory state; `init(task)`
                  returns the episode's first state, `check(state, task)` judges the end (a bool, or
                  {"success", "subgoals_done", "violations"}), optional `user_turn(state, task)` returns what the user
                  says when the agent ends its turn (a follow-up request), or None to end the episode
    tasks/<suite>.jsonl   one task a line: {"id", "instruction", "level"?, "payload"?, "solution"?}; the file's name is
                  the suite; `payload` is what only tools.py reads (as task["payload"]); `solution` the expert's
                  replies in order, each a list of calls [{"name", "arguments"}], a text (ending its turn), or
                  {"thought": text, "calls": [...]} (a short thought before the calls)

The agent calls tools with JSON, one call {"name": ..., "arguments": {...}} or several (a list, or one object after
another, or in <tool_call> tags); a reply without a call ends its turn. tools.py runs in the sandbox's isolated
worker (`sandbox.worker`: no network, uid nobody, CPU/memory/syscall limits, a fresh process per episode, imports
limited to `worker_entry.TOOL_MODULES`); the parent sees only the JSON it returns.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from components.core.env import StepResult
from components.core.rewards import score
from components.core.schema import RewardBreakdown, Task, Trajectory, Turn, Verdict, read_jsonl, to_record
from components.sandbox.worker import CodeRunner, Limits

__all__ = ["FileEnv", "FileEnvironment", "FileSpec", "load_files", "load_helpdesk", "parse_calls", "read_spec", "render_reply"]

EXAMPLE = "helpdesk"  # the example domain shipped in components/sandbox/envs/
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SpecError(ValueError):
    """A file of an environment folder that does not say what it must; the message names the file."""


@dataclass
class FileSpec:
    root: Path
    name: str
    system_prompt: str
    tools: list[dict[str, Any]]
    source: str  # tools.py
    suites: dict[str, list[Task]]
    heldout: tuple[str, ...]
    max_turns: int = 8
    rewards: dict[str, float] = field(default_factory=lambda: {"tool_error": -0.05, "format_error": -0.1})
    user_turns: bool = False  # tools.py defines user_turn

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (json.dumps(self.tools, sort_keys=True), self.source, self.system_prompt,
                     json.dumps({s: [to_record(t) for t in ts] for s, ts in sorted(self.suites.items())}, sort_keys=True)):
            h.update(part.encode())
        return h.hexdigest()


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: missing (an environment folder holds env.json, tools.json, tools.py, tasks/)") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: not JSON ({exc})") from None


def read_spec(path: str | Path) -> FileSpec:
    """Read and check an environment folder; every error names the file and what was expected."""
    root = Path(path)
    meta = _json(root / "env.json")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise SpecError(f"{root / 'env.json'}: expected an object with a 'name'")
    tools = _json(root / "tools.json")
    if not isinstance(tools, list) or not tools:
        raise SpecError(f"{root / 'tools.json'}: expected a list of tool schemas")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(fn, dict) and t.get("type") == "function" and _NAME.match(str(fn.get("name", "")))
                and isinstance(fn.get("parameters", {}), dict)):
            raise SpecError(f"{root / 'tools.json'}[{i}]: expected {{'type': 'function', 'function': {{'name': "
                            "<identifier>, 'description': ..., 'parameters': <JSON schema>}}}}")
        names.append(fn["name"])
    try:
        source = (root / "tools.py").read_text()
        defined = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    except FileNotFoundError:
        raise SpecError(f"{root / 'tools.py'}: missing") from None
    except SyntaxError as exc:
        raise SpecError(f"{root / 'tools.py'}:{exc.lineno}: {exc.msg}") from None
    missing = [n for n in [*names, "check"] if n not in defined]
    if missing:
        raise SpecError(f"{root / 'tools.py'}: defines no {missing} (one function per tool in tools.json, and check)")
    suites: dict[str, list[Task]] = {}
    for f in sorted((root / "tasks").glob("*.jsonl")):
        suites[f.stem] = [_task(f, n, line, f.stem) for n, line in enumerate(f.read_text().splitlines(), 1)
                          if line.strip()]
    heldout = tuple(meta.get("heldout", [s for s in suites if s not in ("train", "practice")]))
    for s in ("train", *heldout):
        if not suites.get(s):
            raise SpecError(f"{root / 'tasks' / (s + '.jsonl')}: missing or empty (the train suite and every held-out "
                            f"suite of env.json need tasks)")
    return FileSpec(root, meta["name"], str(meta.get("system_prompt", "")), tools, source, suites, heldout,
                    int(meta.get("max_turns", 8)), {**FileSpec.__dataclass_fields__["rewards"].default_factory(),
                                                    **meta.get("rewards", {})}, "user_turn" in defined)


def _task(path: Path, line_no: int, line: str, suite: str) -> Task:
    try:
        d = json.loads(line)
        solution = d.get("solution")
        return Task(id=str(d["id"]), instruction=str(d["instruction"]), suite=suite, level=int(d.get("level", 1)),
                    scenario_id=str(d.get("scenario", "")), tags=list(d.get("tags", [])),
                    payload=dict(d.get("payload", {})), solution={"replies": solution} if solution else {})
    except (ValueError, KeyError, TypeError) as exc:
        raise SpecError(f"{path}:{line_no}: {type(exc).__name__}: {exc} (expected {{'id', 'instruction', 'level'?, "
                        "'payload'?, 'solution'?}})") from None


# ----------------------------------------------------------------------------------------------
# Actions: tool calls as JSON
# ----------------------------------------------------------------------------------------------
def parse_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls in a reply: every JSON object (or list of objects) with a 'name' and 'arguments', in order,
    bare or inside <tool_call> tags. No JSON at all: no call (the reply ends the turn). Raises ValueError for JSON
    that is not a call."""
    dec = json.JSONDecoder()
    calls: list[tuple[str, dict[str, Any]]] = []
    i = 0
    while True:
        starts = [j for j in (text.find("{", i), text.find("[", i)) if j >= 0]
        if not starts:
            return calls
        j = min(starts)
        try:
            value, end = dec.raw_decode(text, j)
        except json.JSONDecodeError:
            if text[j] == "[":  # a bracket in prose, not JSON
                i = j + 1
                continue
            raise ValueError(f"malformed JSON at character {j}") from None
        for call in value if isinstance(value, list) else [value]:
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                    and isinstance(call.get("arguments", {}), dict) and set(call) <= {"name", "arguments"}):
                raise ValueError('a call is {"name": <tool>, "arguments": {...}}')
            calls.append((call["name"], dict(call.get("arguments", {}))))
        i = end


def render_reply(reply: Any) -> str:
    """The expert's reply as text: a list of calls as JSON (a list when there are several), a text as it is, or
    {"thought": text, "calls": [...]} as the thought, a line break and the calls."""
    if isinstance(reply, dict):
        return f"{reply['thought']}\n{render_reply(list(reply['calls']))}" if reply.get("calls") else reply["thought"]
    if isinstance(reply, list):
        return json.dumps(reply[0] if len(reply) == 1 else reply, ensure_ascii=False)
    return str(reply)


# ----------------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------------
class FileEnv:
    """One episode at a time over a FileSpec (`core.env.Environment`); tools.py lives in its worker."""

    def __init__(self, spec: FileSpec, limits: Limits | None = None) -> None:
        self.spec = spec
        self.tools = spec.tools
        self.system_prompt = spec.system_prompt
        self.names = {t["function"]["name"] for t in spec.tools}
        self.runner = CodeRunner(limits or Limits(cpu_time_s=2.0, memory_mb=256, wall_timeout_s=5.0))
        self.task: Task | None = None
        self.turns = 0
        self.format_errors = 0
        self.failed = ""

    def reset(self, task: Task) -> str:
        self.task, self.turns, self.format_errors, self.failed = task, 0, 0, ""
        self.runner.reset()
        ok, _, err = self.runner.request(("load", self.spec.source, _task_view(task)))
        if not ok:
            raise RuntimeError(f"{self.spec.root / 'tools.py'}: init failed for task {task.id}: {err}")
        return task.instruction

    def step(self, action_text: str) -> StepResult:
        self.turns += 1
        try:
            calls = parse_calls(action_text)
        except ValueError as exc:
            self.format_errors += 1
            parts = {"format_error": self.spec.rewards["format_error"]}
            return self._limit(StepResult(f"Format error: {exc}. Call tools with JSON: "
                                          '{"name": <tool>, "arguments": {...}}', parts["format_error"], False,
                                          {"format_error": True, "reward_parts": parts}))
        if not calls:  # the agent ends its turn: the user may follow up
            self._call("__finish__", {"answer": action_text})
            follow = self._call("__user_turn__", {})[1] if self.spec.user_turns else None
            if isinstance(follow, str) and follow:
                return self._limit(StepResult(follow, 0.0, False, {"user_turn": True, "reward_parts": {}}, "user"))
            return StepResult("The conversation is over.", 0.0, True, {"reward_parts": {}})
        lines, errors = [], 0
        for name, args in calls:
            if name not in self.names:
                ok, value, err = False, None, f"unknown tool {name!r}; tools: {sorted(self.names)}"
            else:
                ok, value, err = self._call(name, args)
            errors += not ok
            lines.append(json.dumps({"name": name, **({"result": value} if ok else {"error": err})}, ensure_ascii=False,
                                    default=str))
        parts = {"tool_error": self.spec.rewards["tool_error"] * errors} if errors else {}
        return self._limit(StepResult("\n".join(lines), sum(parts.values()), False,
                                      {"calls": [n for n, _ in calls], "reward_parts": parts}))

    def _call(self, name: str, args: dict[str, Any]) -> tuple[bool, Any, str]:
        ok, value, err = self.runner.request(("tool", name, args))
        if not ok and err.startswith(("WorkerError", "TimeoutError")):
            self.failed = err  # the episode's state is gone with the worker
        return ok, value, err

    def _limit(self, res: StepResult) -> StepResult:
        if self.failed:
            res.done, res.info["truncated"] = True, "environment_error"
        elif self.turns >= self.spec.max_turns:
            res.done, res.info["truncated"] = True, "max_turns"
        return res

    def verify(self) -> Verdict:
        if self.failed:
            return Verdict(False)
        ok, value, err = self.runner.request(("tool", "__check__", {}))
        if not ok:
            raise RuntimeError(f"{self.spec.root / 'tools.py'}: check failed for task {self.task.id}: {err}")
        if isinstance(value, dict):
            return Verdict(bool(value.get("success")), [str(x) for x in value.get("subgoals_done", [])],
                           [str(x) for x in value.get("violations", [])])
        return Verdict(bool(value))

    def episode_info(self) -> dict[str, Any]:
        return {"format_errors": self.format_errors}

    def close(self) -> None:
        self.runner.close()


def _task_view(task: Task) -> dict[str, Any]:
    """What tools.py sees of a task (never the solution)."""
    return {"id": task.id, "instruction": task.instruction, "suite": task.suite, "level": task.level,
            "payload": task.payload}


def play(env: FileEnv, task: Task, replies: list[Any], policy: str = "expert") -> Trajectory:
    """The expert's episode: `replies` in order (a list of calls, or a text), as a Trajectory like a rollout's."""
    first = env.reset(task)
    turns = [Turn("system", env.system_prompt, info={"tools": env.tools}), Turn("user", first)]
    done = False
    for reply in replies:
        text = render_reply(reply)
        res = env.step(text)
        turns.append(Turn("assistant", text))
        turns.append(Turn(res.role, res.observation, observation=res.observation, step_reward=res.step_reward,
                          info=dict(res.info)))
        if res.done:
            done = True
            break
    verdict = env.verify()
    traj = Trajectory(task.id, policy, turns, verdict, RewardBreakdown(0.0), steps=sum(t.role == "assistant"
                                                                                        for t in turns),
                      finish_reason="finish" if done else "max_turns", truncated=not done,
                      meta={"scenario_id": task.scenario_id, "level": task.level, "suite": task.suite})
    traj.reward = score(traj, verdict, max_turns=env.spec.max_turns)
    return traj


# ----------------------------------------------------------------------------------------------
# The loaded environment (core.env.LoadedEnvironment)
# ----------------------------------------------------------------------------------------------
@dataclass
class FileEnvironment:
    spec: FileSpec
    suites: dict[str, list[Task]]
    heldout: tuple[str, ...]
    url: str | None = None  # episodes on an environment server (`agentrl env serve`) instead of this process

    def online_tasks(self, pool: str = "practice") -> list[Task]:
        """'practice' when the folder has that suite (tasks no demo shows), else the train suite."""
        return list(self.suites.get(pool) or self.suites["train"])

    def factory(self, action_format: str | None = None) -> Callable[[], Any]:
        if self.url:
            from components.sandbox.server import HTTPEnvironment

            return lambda: HTTPEnvironment(self.url)
        return lambda: FileEnv(self.spec)  # the action form is the folder's (JSON tool calls)

    def expert(self, env: Any, task: Task, action_format: str | None = None) -> Trajectory | None:
        """The task's `solution` played in a fresh episode of this process (the expert is trusted); None without."""
        if not task.solution.get("replies"):
            return None
        own = FileEnv(self.spec)
        try:
            return play(own, task, task.solution["replies"])
        finally:
            own.close()

    def describe(self) -> dict[str, Any]:
        """What sandbox_build writes as world.json: where the folder is and what it held."""
        return {"environment": self.spec.name, "path": str(self.spec.root), "digest": self.spec.digest()}


def load_files(cfg: Any, world_path: str | None = None, tasks_dir: str | None = None, path: str | None = None,
               **options: Any) -> FileEnvironment:
    """The loader (`core.env.load`) of an environment folder (`env.options.path`); with a sandbox_build's outputs the
    suites are those it wrote, and its world.json must describe the same folder (by digest)."""
    from components.core import storage

    if options:
        raise ValueError(f"env.options={sorted(options)}: a file-defined environment takes only 'path'")
    if not path:
        raise ValueError("env.options.path: the folder of a file-defined environment (env.json, tools.json, tools.py, "
                         "tasks/) is required")
    spec = read_spec(path)
    suites = spec.suites
    if tasks_dir:
        built = json.loads(storage.read_text(world_path)) if world_path else {}
        if built.get("digest") not in (None, spec.digest()):
            raise ValueError(f"{world_path}: built from another version of {path} (digest {built.get('digest')[:12]}, "
                             f"the folder's {spec.digest()[:12]})")
        suites = {s: list(read_jsonl(storage.join(tasks_dir, f"{s}.jsonl"), Task)) for s in spec.suites}
    if cfg.env.url:
        from components.sandbox.suites import check_server

        check_server(cfg.env.url, spec.digest()[:16], f"serve this folder (`agentrl env serve --env {cfg.env.name}` with "
                     "the same env.options)")
    return FileEnvironment(spec, suites, spec.heldout, cfg.env.url)


def example_path(name: str = EXAMPLE) -> str:
    return str(resources.files("components.sandbox") / "envs" / name)


def load_helpdesk(cfg: Any, world_path: str | None = None, tasks_dir: str | None = None,
                  **options: Any) -> FileEnvironment:
    """The example domain (a help-desk ticket system), a file-defined environment shipped with agentrl."""
    return load_files(cfg, world_path, tasks_dir, path=options.pop("path", None) or example_path(), **options)
