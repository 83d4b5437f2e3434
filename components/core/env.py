"""The Environment protocol (DESIGN.md §4) and the registry of environments by name.

An environment is reset with a Task, stepped with the agent's raw text (it parses the action
itself: malformed text is an observation, never an exception), and verified at the end. Third
parties register theirs through the `agentrl.environments` entry-point group:

    [project.entry-points."agentrl.environments"]
    myenv = "mypackage.env:make_env"      # a callable returning an Environment
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from components.core.schema import Task, Trajectory, Verdict

__all__ = ["Environment", "LoadedEnvironment", "StepResult", "available", "by_family", "interleave_families", "load",
           "loader_names", "make", "pick_suites", "world_beside"]

GROUP = "agentrl.environments"


@dataclass
class StepResult:
    """What the environment answers to one agent turn.

    `role`: 'tool' (a tool's output) or 'user' (the user speaks mid-episode: a follow-up request, a clarification's
    answer); the rollout renders the observation in that role. `step_reward`: this turn's shaping, counted in the
    episode's reward (as `info["reward_parts"]` by name when the environment names its parts, else as the `step`
    part); `info["truncated"]` on a `done` step names a stop that was not the agent's own."""

    observation: str
    step_reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    role: str = "tool"

    def __post_init__(self) -> None:
        if self.role not in ("tool", "user"):
            raise ValueError(f"StepResult.role={self.role!r}: expected 'tool' or 'user'")

    def to_dict(self) -> dict[str, Any]:
        return {"observation": self.observation, "step_reward": self.step_reward, "done": self.done,
                "info": self.info, "role": self.role}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepResult:
        return cls(d["observation"], float(d["step_reward"]), bool(d["done"]), dict(d.get("info") or {}),
                   str(d.get("role") or "tool"))


@runtime_checkable
class Environment(Protocol):
    """Optional attributes the rollout reads: `system_prompt` (str: the system turn), `tools` (a list of tool
    declarations as JSON schemas, OpenAI's function format: put in the prompt through the model's chat template
    when it takes `tools=`, else rendered into the system turn), `episode_info()` (skills, format errors).

    Isolation is the environment's job: an environment that executes what the agent writes (code, shell, SQL) must
    run it behind its own walls (the workspace and the file-defined environment use `sandbox.worker`: a separate
    process without network, as uid nobody, with CPU, memory and syscall limits); the rollout only passes text."""

    def reset(self, task: Task) -> str:
        """Start an episode on `task`; returns the first observation (the system prompt + instruction)."""

    def step(self, action_text: str) -> StepResult:
        """Apply the agent's turn (raw text); never raises for bad input."""

    def verify(self) -> Verdict:
        """Judge the end state of the episode."""

    def close(self) -> None:
        """Release workers, sockets, files."""


def available() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def make(name: str, **kwargs: Any) -> Environment:
    eps = available()
    if name not in eps:
        raise KeyError(f"environment {name!r} is not registered in {GROUP!r}; known: {sorted(eps)}")
    return eps[name].load()(**kwargs)


# ----------------------------------------------------------------------------------------------
# A loaded environment: what every phase gets its tasks, suites, episodes and expert from
# ----------------------------------------------------------------------------------------------
LOADERS = "agentrl.environment_loaders"
BUILTIN_LOADERS = {  # without an install step: the workspace (the default) and the file-defined environments
    "workspace": "components.sandbox.suites:load_sandbox",
    "files": "components.sandbox.files:load_files",  # env.options.path: a folder (sandbox/files.py)
    "helpdesk": "components.sandbox.files:load_helpdesk",  # the example folder shipped in sandbox/envs/helpdesk
}


@runtime_checkable
class LoadedEnvironment(Protocol):
    """An environment with its task sources, as `load` returns it (the workspace's is `sandbox.suites.Sandbox`).

    `suites`: task lists by name ('train' for the SFT demos, 'practice' for online phases, and the held-out ones
    named in `heldout`)."""

    suites: dict[str, list[Task]]
    heldout: tuple[str, ...]

    def online_tasks(self, pool: str = "practice") -> list[Task]:
        """The tasks GRPO, rejection sampling and simulated A/B requests sample on."""

    def factory(self, action_format: str | None = None) -> Callable[[], Environment]:
        """A maker of fresh environments (one per sampled chain of tasks)."""

    def expert(self, env: Environment, task: Task, action_format: str | None = None) -> Trajectory | None:
        """An expert solution of `task` played in `env` (for SFT demos, repair and DPO corrections); None when the
        environment has none for it (phases then go without: no demo, no repair sample, no correction)."""


def loader_names() -> set[str]:
    """The environments `load` can give (registered loaders and the built-in workspace)."""
    return {ep.name for ep in entry_points(group=LOADERS)} | set(BUILTIN_LOADERS)


def load(cfg: Any, world: str | None = None, tasks_dir: str | None = None) -> LoadedEnvironment:
    """The environment `cfg.env.name` with its tasks: from a built sandbox (`tasks_dir`, and `world` or the world.json
    beside it) when given, else generated from the config. Loaders register under the `agentrl.environment_loaders`
    entry-point group: `loader(cfg, world_path, tasks_dir, **cfg.env.options) -> LoadedEnvironment`; with
    `cfg.env.url` the loaded environment's episodes run on that server."""
    from importlib import import_module

    name = cfg.env.name
    eps = {ep.name: ep.value for ep in entry_points(group=LOADERS)}
    target = eps.get(name) or BUILTIN_LOADERS.get(name)
    if target is None:
        raise KeyError(f"env.name={name!r}: no loader in {LOADERS!r}; known: {sorted(loader_names())}")
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)(cfg, world_beside(tasks_dir, world), tasks_dir or None,
                                                **cfg.env.options)


def pick_suites(env: LoadedEnvironment, wanted: Sequence[str] | None, fallback: bool = True) -> list[str]:
    """The configured suites this environment has; when it has none of them (the defaults name the workspace's),
    its own held-out suites (`fallback`), else none."""
    have = [s for s in (wanted or ()) if s in env.suites]
    return have if have or not fallback else list(env.heldout)


def by_family(tasks: Sequence[Task]) -> dict[str, list[Task]]:
    """The tasks by scenario family, each family's order kept: the scenario id before its first ':' (the
    workspace's `mail_to_event:alice` is `mail_to_event`); an environment without families gives each scenario its
    own. The online phases draw over families, so a family of 5 instances is practised beside one of 124."""
    out: dict[str, list[Task]] = {}
    for t in tasks:
        out.setdefault(t.scenario_id.split(":")[0], []).append(t)
    return out


def interleave_families(tasks: Sequence[Task]) -> list[Task]:
    """The tasks in turns of their scenario families (first of each family, then second, ...), each family's order
    kept: the first k of the result spread over the families."""
    queues = list(by_family(tasks).values())
    out: list[Task] = []
    for i in range(max(map(len, queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


def world_beside(tasks_dir: str | None, world: str | None) -> str | None:
    """`world` if given, else the world.json of the sandbox_build output that holds `tasks_dir`."""
    from pathlib import Path

    if tasks_dir and not world and (Path(tasks_dir).parent / "world.json").exists():
        return str(Path(tasks_dir).parent / "world.json")
    return world or None
