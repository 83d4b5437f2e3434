"""The workspace as a loaded environment (`core.env.LoadedEnvironment`): its suites, its episodes and its expert.

Phases never import this module: they call `core.env.load`, which finds the environment by name (the workspace is
the built-in default) and returns a `Sandbox`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from components.core.config import PipelineConfig
from components.core.env import Environment
from components.core.schema import Task, Trajectory, read_jsonl
from components.sandbox.tasks import generate_tasks
from components.sandbox.world import World, generate_world

__all__ = ["ALL", "HELDOUT", "Sandbox", "load_sandbox"]

HELDOUT = ("easy", "hard", "safety", "robustness")  # the held-out suites (never trained on)
ALL = ("train", *HELDOUT, "practice")  # every suite sandbox_build writes


@dataclass
class Sandbox:
    world: World
    suites: dict[str, list[Task]]
    config: PipelineConfig | None = None  # the sandbox and reward settings its episodes run with
    heldout: tuple[str, ...] = HELDOUT

    def factory(self, action_format: str | None = None) -> Callable[[], Environment]:
        """A maker of environments, one per sampled chain: each starts with an empty skill library (SAGE carries skills
        from one task of a chain to the next, never across chains)."""
        cfg = self._config()
        if cfg.env.url:  # the episodes run on the environment server (the same world: checked when loaded)
            from components.sandbox.server import HTTPEnvironment

            return lambda: HTTPEnvironment(cfg.env.url, action_format=action_format or cfg.sandbox.action_format)
        from components.sandbox.workspace import WorkspaceEnv

        return lambda: WorkspaceEnv(self.world, cfg.sandbox, cfg.rewards, action_format=action_format)

    def expert(self, env: Environment, task: Task, action_format: str | None = None) -> Trajectory:
        """The scripted expert's solution of `task`, played in `env` (in the configured action form by default)."""
        from components.sandbox import expert
        from components.sandbox.workspace import WorkspaceEnv

        cfg = self._config()
        form = action_format or cfg.sandbox.action_format
        own = None
        if not isinstance(env, WorkspaceEnv):  # a served episode: the expert (trusted) plays in this process
            env = own = WorkspaceEnv(self.world, cfg.sandbox, cfg.rewards, action_format=form)
        try:
            traj = (expert.solve_code if form == "code" else expert.solve_json)(env, task)[0]
            info = env.episode_info()
        finally:
            if own is not None:
                own.close()
        traj.skills_defined, traj.skills_used = list(info.get("skills_defined", [])), list(info.get("skills_used", []))
        return traj

    def _config(self) -> PipelineConfig:
        if self.config is None:
            raise ValueError("this Sandbox was built without a config: load it with core.env.load(cfg, ...)")
        return self.config

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


def load_sandbox(cfg: PipelineConfig, world_path: str | None = None, tasks_dir: str | None = None,
                 **options: object) -> Sandbox:
    """The workspace's loader (`core.env.load`): the sandbox_build outputs when given; else regenerated from the config
    (deterministic for a seed). It takes no options (its settings are the config's `sandbox` section). With
    `env.url`, the server must serve the same world: its /healthz digest is checked here, before any episode."""
    import json

    from components.core import storage

    if options:
        raise ValueError(f"env.options={sorted(options)}: the workspace takes no options (set its `sandbox` section)")
    if world_path and tasks_dir:
        world = World.from_dict(json.loads(storage.read_text(world_path)))
        suites = {s: list(read_jsonl(storage.join(tasks_dir, f"{s}.jsonl"), Task)) for s in ("train", *HELDOUT)}
        practice = storage.join(tasks_dir, "practice.jsonl")  # absent from sandboxes built before it existed
        suites["practice"] = list(read_jsonl(practice, Task)) if storage.exists(practice) else []
    else:
        world = generate_world(cfg.sandbox)
        suites = generate_tasks(world, cfg.sandbox)
    if cfg.env.url:
        check_server(cfg.env.url, world.digest()[:16], "start the server with this sandbox's world.json (`agentrl "
                     "sandbox serve --world ...`) or the same sandbox config")
    return Sandbox(world, suites, cfg)


def check_server(url: str, digest: str, how: str) -> None:
    """The server at `url` answers and serves the environment whose digest is `digest` (its /healthz `world`): tasks
    name what is in it (users, ids, tickets), another one fails them. `how`: what to do about a mismatch."""
    import requests

    try:
        health = requests.get(url.rstrip("/") + "/healthz", timeout=10).json()
    except (requests.RequestException, ValueError) as exc:
        raise ValueError(f"env.url={url!r}: no environment server answers ({type(exc).__name__}: {exc})") from None
    if health.get("world") != digest:
        raise ValueError(f"env.url={url!r} serves world {health.get('world')}, the phase's tasks are for {digest}: "
                         + how)
