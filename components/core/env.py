"""The Environment protocol (DESIGN.md §4) and the registry of environments by name.

An environment is reset with a Task, stepped with the agent's raw text (it parses the action
itself: malformed text is an observation, never an exception), and verified at the end. Third
parties register theirs through the `agentrl.environments` entry-point group:

    [project.entry-points."agentrl.environments"]
    myenv = "mypackage.env:make_env"      # a callable returning an Environment
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from components.core.schema import Task, Verdict

__all__ = ["Environment", "StepResult", "available", "make"]

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
