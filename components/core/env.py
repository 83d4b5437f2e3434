"""The Environment protocol (DESIGN.md §4) and the registry of environments by name.

An environment is reset with a Task, stepped with the agent's raw text (it parses the action
itself: malformed text is an observation, never an exception), and verified at the end. Third
parties register theirs through the `agentrl.environments` entry-point group:

    [project.entry-points."agentrl.environments"]
    myenv = "mypackage.env:make_env"      # a callable returning an Environment
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from components.core.schema import Task, Trajectory, Verdict

__all__ = ["Environment", "LoadedEnvironment", "StepResult", "available", "load", "loader_names", "make",
           "world_beside"]

GROUP = "agentrl.environments"


@dataclass
class StepResult:
    observation: str
    step_reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"observation": self.observation, "step_reward": self.step_reward, "done": self.done,
                "info": self.info}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepResult:
        return cls(d["observation"], float(d["step_reward"]), bool(d["done"]), dict(d.get("info") or {}))


@runtime_checkable
class Environment(Protocol):
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
BUILTIN_LOADERS = {"workspace": "components.sandbox.suites:load_sandbox"}  # the default, without an install step


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

    def expert(self, env: Environment, task: Task, action_format: str | None = None) -> Trajectory:
        """An expert solution of `task` played in `env` (for supervision and repair)."""


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


def world_beside(tasks_dir: str | None, world: str | None) -> str | None:
    """`world` if given, else the world.json of the sandbox_build output that holds `tasks_dir`."""
    from pathlib import Path

    if tasks_dir and not world and (Path(tasks_dir).parent / "world.json").exists():
        return str(Path(tasks_dir).parent / "world.json")
    return world or None
