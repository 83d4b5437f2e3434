"""The sandbox's suites, and loading a built sandbox (world + suites) for any phase: the sandbox owns them, so a
phase that needs tasks imports the environment's folder, not another phase's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from components.core.config import PipelineConfig
from components.core.schema import Task, read_jsonl
from components.sandbox.tasks import generate_tasks
from components.sandbox.world import World, generate_world

__all__ = ["ALL", "HELDOUT", "Sandbox", "load_sandbox", "world_beside"]

HELDOUT = ("easy", "hard", "safety", "robustness")  # the held-out suites (never trained on)
ALL = ("train", *HELDOUT, "practice")  # every suite sandbox_build writes


@dataclass
class Sandbox:
    world: World
    suites: dict[str, list[Task]]

    def online_tasks(self, pool: str = "practice") -> list[Task]:
        """The tasks the online phases (GRPO, rejection sampling, simulated A/B requests) sample on.
        'practice': per level, instances no SFT demo shows (the practice suite), so a success needs what generalises
        (reading ids and values from the context), not a memorised demo; the train suite's at a level the practice
        suite lacks (the train suite used its whole pool). 'train': the SFT demos' own tasks."""
        if pool == "train":
            return list(self.suites["train"])
        practice = self.suites.get("practice", [])
        have = {t.level for t in practice}
        return list(practice) + [t for t in self.suites["train"] if t.level not in have]


def load_sandbox(cfg: PipelineConfig, world_path: str | None = None, tasks_dir: str | None = None) -> Sandbox:
    """The sandbox_build outputs when given; else regenerated from the config (deterministic for a seed)."""
    import json

    from components.core import storage

    if world_path and tasks_dir:
        world = World.from_dict(json.loads(storage.read_text(world_path)))
        suites = {s: list(read_jsonl(storage.join(tasks_dir, f"{s}.jsonl"), Task)) for s in ("train", *HELDOUT)}
        practice = storage.join(tasks_dir, "practice.jsonl")  # absent from sandboxes built before it existed
        suites["practice"] = list(read_jsonl(practice, Task)) if storage.exists(practice) else []
        return Sandbox(world, suites)
    world = generate_world(cfg.sandbox)
    return Sandbox(world, generate_tasks(world, cfg.sandbox))


def world_beside(tasks_dir: str | None, world: str | None) -> str | None:
    """`world` if given, else the world.json of the sandbox_build output that holds `tasks_dir`."""
    if tasks_dir and not world and (Path(tasks_dir).parent / "world.json").exists():
        return str(Path(tasks_dir).parent / "world.json")
    return world or None
