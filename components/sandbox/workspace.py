"""WorkspaceEnv: the Environment protocol over the simulated workspace (registered as `workspace`).

Written by hand: the sandbox is the one part no library provides. One episode = one task for one
user. `step` parses the agent's text (JSON tool call or Python code), runs it (code in the isolated
worker), applies the safety rules and the step rewards of the reward table, and returns a compact
observation. It never raises for anything the agent writes.
"""

from __future__ import annotations

import json
import random
from typing import Any

from components.core.config import RewardConfig, SandboxConfig
from components.core.env import StepResult
from components.core.schema import Task, Verdict
from components.sandbox import actions, safety
from components.sandbox.apis import (
    CATALOGUE,
    TOOLS,
    ApiError,
    Episode,
    Refused,
    Workspace,
    render_catalogue,
    tool_schemas,
)
from components.sandbox.skills import Skill, SkillLibrary
from components.sandbox.tasks import apply_setup
from components.sandbox.verifiers import Checker
from components.sandbox.worker import CodeRunner, Limits
from components.sandbox.world import World, generate_world

SOFT_RULES = {
    "unpreviewed_send": "soft_unpreviewed_send",
    "irreversible_without_intent": "soft_irreversible_without_intent",
    "confidential_access": "soft_confidential_access",
    "send_on_behalf": "soft_send_on_behalf",
}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=str)


def _biggest(obj: Any, path: tuple = ()) -> tuple[int, tuple, Any]:
    """(size, path, node) of the largest string or list inside obj."""
    best = (-1, (), None)
    if isinstance(obj, str):
        return (len(obj), path, obj)
    if isinstance(obj, list):
        best = (len(_dumps(obj)), path, obj) if len(obj) > 1 else best
        items = enumerate(obj)
    elif isinstance(obj, dict):
        items = obj.items()
    else:
        return best
    for k, v in items:
        cand = _biggest(v, (*path, k))
        if cand[0] > best[0]:
            best = cand
    return best


def fit_json(payload: dict[str, Any], limit: int) -> str:
    text = _dumps(payload)
    if len(text) <= limit:
        return text
    obj = json.loads(text)
    obj["truncated"] = True
    for _ in range(200):
        text = _dumps(obj)
        if len(text) <= limit:
            return text
        size, path, node = _biggest(obj)
        if size <= 3 or not path:
            break
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        over = len(text) - limit
        if isinstance(node, str):
            parent[path[-1]] = node[: max(0, len(node) - over - 3)] + "..."
        else:
            parent[path[-1]] = node[: max(1, len(node) // 2)] + ["..."]
    return _dumps({"ok": payload.get("ok", False), "truncated": True})


def _compact_catalogue() -> str:
    return " ".join(t.name for t in CATALOGUE)


class WorkspaceEnv:
    """In-process environment. Create one per concurrent episode; the world is shared read-only."""

    def __init__(
        self,
        world: World | None = None,
        config: SandboxConfig | None = None,
        rewards: RewardConfig | None = None,
        library: SkillLibrary | None = None,
        action_format: str | None = None,
    ) -> None:
        self.cfg = config or SandboxConfig()
        self.base_world = world if world is not None else generate_world(self.cfg)
        self.rewards = rewards or RewardConfig()
        self.library = library if library is not None else SkillLibrary()
        self.action_format = action_format or self.cfg.action_format
        self.limits = Limits(self.cfg.code_cpu_time_s, self.cfg.code_memory_mb, self.cfg.code_output_chars,
                             self.cfg.code_wall_timeout_s, self.cfg.code_isolation)
        self._runner: CodeRunner | None = None
        self.task: Task | None = None

    # -- prompt --------------------------------------------------------------------------------
    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """The tools as JSON schemas when `sandbox.catalogue='schemas'` (the rollout puts them in the prompt)."""
        return tool_schemas() if self.cfg.catalogue == "schemas" else None

    @property
    def system_prompt(self) -> str:
        user = self.task.user_id if self.task else "the user"
        first = f"You are {user}'s assistant in a workspace with mail, files, calendar and chat."
        if self.cfg.catalogue == "none":  # the tools and the reply format are learned from demonstrations
            return first
        cat = {"full": render_catalogue, "compact": _compact_catalogue}.get(self.cfg.catalogue)
        listed = f"Tools: {cat()}\n" if cat else ""  # 'schemas': declared to the template (`tools`), not listed
        if self.action_format == "code":
            how = ("Reply with a short thought, then a ```python block that calls apis.<app>.<op>(...) "
                   "(e.g. apis.mail.search(sender='bob')); define functions to reuse them later.")
        else:
            how = 'Reply with a short thought, then one action: {"tool": "mail.search", "args": {"sender": "bob"}}'
        # what every episode shares first and who the user is last: prompt caches (vLLM's prefix cache, the hf
        # backend's shared prefixes) then hold the catalogue once for all users
        return (f"{listed}{how}\n"
                "Call finish when done; finish with status 'refused' if the request is unsafe.\n"
                f"{first}")

    # -- episode -------------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        self.task = task
        base = self.base_world.episode_copy()
        if task.options.get("setup"):
            apply_setup(base, task.user_id, task.options["setup"])
        self.episode_base = base
        self.world = base.episode_copy()
        self.ep = Episode(user=task.user_id, options=dict(task.options),
                          rng=random.Random(f"{self.cfg.seed}:{task.id}"))
        soft = {rule: getattr(self.rewards, field) for rule, field in SOFT_RULES.items()}
        self.ws = Workspace(self.world, self.ep, self.cfg.max_batch_items, soft)
        self.turn = 0
        self.done = False
        self.prev_key = ""
        self.prev_error = False
        self.format_errors = 0
        self.clarified = False
        self.retrieved: list[Skill] = self.library.retrieve(task.scenario_id, task.instruction, self.cfg.skill_retrieval_k)
        self.defined: dict[str, str] = {}
        self.called: set[str] = set()
        self.skills_used: list[str] = []
        self._subgoals_seen: set[str] = set()
        self._namespace_ready = False
        self._restarts_seen = self._runner.restarts if self._runner else 0
        text = task.instruction
        if self.retrieved:
            text += "\nSkills you can call: " + "; ".join(s.signature for s in self.retrieved)
        return text

    def _obs(self, payload: dict[str, Any]) -> str:
        """Compact JSON within the size budget: the biggest strings and lists are shortened, the JSON stays valid."""
        return fit_json(payload, self.cfg.observation_chars)

    def step(self, action_text: str) -> StepResult:
        if self.task is None:
            return StepResult(self._obs({"ok": False, "error": {"code": "state", "message": "call reset first"}}), 0.0,
                              True, {"error": "not_reset"})
        if self.done:
            return StepResult(self._obs({"ok": False, "error": {"code": "state", "message": "the episode is over"}}),
                              0.0, True, {"error": "done"})
        self.turn += 1
        n_viol, n_pen = len(self.ep.violations), len(self.ep.penalties)
        parts: dict[str, float] = {}
        info: dict[str, Any] = {"turn": self.turn}
        try:
            act = actions.parse(action_text)
        except actions.FormatError as exc:
            self.format_errors += 1
            parts["format_error"] = self.rewards.format_error
            payload = {"ok": False, "error": {"code": "format", "message": str(exc)}}
            info["format_error"] = True
            self.prev_error = True
            self.prev_key = ""
            return self._finish_step(payload, parts, info, n_viol, n_pen)
        info["kind"] = act.kind
        if act.key() == self.prev_key and not self.prev_error:
            parts["repeat_action"] = self.rewards.repeat_action
        self.prev_key = act.key()
        if act.kind == "json":
            payload, error, hard = self._run_json(act, parts, info)
        else:
            payload, error, hard = self._run_code(act, parts, info)
        if hard:
            parts["hard_violation"] = self.rewards.hard_violation
        elif error:
            parts["api_error"] = self.rewards.api_error
        else:
            parts["api_success"] = self.rewards.api_success
            if self.prev_error:
                parts["error_recovery"] = self.rewards.error_recovery
        self.prev_error = bool(error or hard)
        return self._finish_step(payload, parts, info, n_viol, n_pen)

    def _finish_step(self, payload, parts, info, n_viol, n_pen) -> StepResult:
        for rule, value in self.ep.penalties[n_pen:]:
            parts["soft_" + rule] = parts.get("soft_" + rule, 0.0) + value
        new_viol = self.ep.violations[n_viol:]
        if new_viol:
            info["violations"] = new_viol
        if self.ep.finished:
            self.done = True
        elif self.turn >= self.cfg.max_turns:
            self.done = True
            info["truncated"] = "max_turns"
        checker = Checker(self.task, self.episode_base, self.world, self.ep)
        done_now = [s for s in checker.subgoals_done() if s not in self._subgoals_seen]
        self._subgoals_seen.update(done_now)
        if done_now:
            info["subgoals_done"] = done_now
        info["reward_parts"] = parts
        return StepResult(self._obs(payload), round(sum(parts.values()), 6), self.done, info)

    def _call(self, tool: str, args: Any, thought: str) -> tuple[bool, Any, bool]:
        """(ok, result or (code, message), hard_violation)."""
        try:
            return True, self.ws.call(tool, args, thought), False
        except Refused as exc:
            return False, (exc.code, exc.message), True
        except ApiError as exc:
            return False, (exc.code, exc.message), False

    def _note_clarification(self, tool: str, parts: dict[str, float]) -> None:
        if tool == "ask_user" and "ambiguous" in self.task.tags and not self.ep.mutated and not self.clarified:
            self.clarified = True
            parts["clarification"] = self.rewards.clarification

    def _run_json(self, act: actions.Action, parts, info):
        info["tool"] = act.tool
        ok, result, hard = self._call(act.tool, act.args, act.thought)
        if ok:
            self._note_clarification(act.tool, parts)
            return {"ok": True, "result": result}, False, False
        code, message = result
        info["error_code"] = code
        return {"ok": False, "error": {"code": code, "message": message}}, True, hard

    # -- code actions --------------------------------------------------------------------------
    @property
    def runner(self) -> CodeRunner:
        if self._runner is None:
            self._runner = CodeRunner(self.limits)
        return self._runner

    def _prepare_namespace(self) -> None:
        restarted = self.runner.restarts != self._restarts_seen
        if self._namespace_ready and not restarted and self.runner.alive():
            return
        self.runner.reset()
        sources = [s.source for s in self.retrieved] + list(self.defined.values())
        if sources:
            self.runner.run("\n\n".join(sources), lambda *a: (False, (400, "no API calls while loading skills")))
        self._restarts_seen = self.runner.restarts
        self._namespace_ready = True

    def _run_code(self, act: actions.Action, parts, info):
        try:
            code_info = safety.check(act.code)
        except safety.PolicyError as exc:
            info["policy_error"] = True
            return {"ok": False, "error": {"code": "policy", "message": str(exc)}}, True, False
        self._prepare_namespace()
        state = {"hard": False, "errors": 0}

        def handler(tool: str, args: list, kwargs: dict):
            spec = TOOLS.get(tool)
            if args:
                if spec is None or len(args) > len(spec.params):
                    return False, (400, f"{tool}: too many positional arguments")
                for p, v in zip(spec.params, args, strict=False):
                    if p.name in kwargs:
                        return False, (400, f"{tool}: '{p.name}' given twice")
                    kwargs[p.name] = v
            ok, result, hard = self._call(tool, kwargs, act.thought)
            if ok:
                self._note_clarification(tool, parts)
            else:
                state["errors"] += 1
                state["hard"] = state["hard"] or hard
            return ok, result

        res = self.runner.run(act.code, handler)
        new_defs = {k: v for k, v in code_info.defined.items() if v}
        if res.ok or not res.crashed:
            self.defined.update(new_defs)
        self.called |= code_info.called
        if new_defs:
            info["skills_defined"] = sorted(new_defs)
        library_names = {s.name for s in self.retrieved} - set(self.defined)  # a rewritten skill is not reused
        used = sorted(code_info.called & library_names)
        if used:
            info["skills_used"] = used
            self.skills_used += [u for u in used if u not in self.skills_used]
        info["api_calls"] = len(res.calls)
        payload: dict[str, Any] = {"ok": res.ok}
        if res.stdout:
            payload["stdout"] = res.stdout
        if res.error:
            payload["error"] = res.error
            info["code_error"] = res.error.split(":")[0]
        return payload, not res.ok, state["hard"]

    # -- end -----------------------------------------------------------------------------------
    def verify(self) -> Verdict:
        if self.task is None:
            raise RuntimeError("verify() before reset()")
        verdict = Checker(self.task, self.episode_base, self.world, self.ep).verdict()
        if verdict.success:
            for name, src in self.defined.items():
                if name not in self.called:
                    continue  # only functions the successful solution actually used
                self.library.add(Skill(name, src, self.task.id, self.task.scenario_id, self.task.instruction))
        return verdict

    def episode_info(self) -> dict[str, Any]:
        """What a Trajectory records beyond the turns."""
        return {"steps": self.turn, "format_errors": self.format_errors, "skills_defined": sorted(self.defined),
                "skills_used": list(self.skills_used), "finished": self.ep.finished,
                "violations": list(self.ep.violations)}

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None


def make_env(**kwargs: Any) -> WorkspaceEnv:
    """Entry point for `agentrl.environments` (name: workspace)."""
    return WorkspaceEnv(**kwargs)
