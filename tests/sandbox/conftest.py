from __future__ import annotations

import pytest

from components.core.config import RewardConfig, SandboxConfig
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import generate_world


@pytest.fixture(scope="session")
def cfg() -> SandboxConfig:
    return SandboxConfig(code_cpu_time_s=1.0, code_wall_timeout_s=3.0, code_memory_mb=128)


@pytest.fixture(scope="session")
def world(cfg):
    return generate_world(cfg)


@pytest.fixture(scope="session")
def suites(world, cfg):
    return generate_tasks(world, cfg)


@pytest.fixture
def env(world, cfg):
    e = WorkspaceEnv(world, cfg, RewardConfig())
    yield e
    e.close()


def first(suites, family: str, suite: str | None = None):
    for name, tasks in suites.items():
        if suite and name != suite:
            continue
        for t in tasks:
            if t.tags[0] == family:
                return t
    raise LookupError(family)
