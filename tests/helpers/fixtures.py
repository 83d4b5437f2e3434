"""Fixtures shared by the runtime tests of both environments (the main suite's tests/core and the vLLM suite,
which runs with --confcutdir and so cannot reach a conftest above it): import them into a conftest or a module."""

from __future__ import annotations

import pytest

from tests.helpers.runtime import make_sandbox, tiny_on_sandbox


@pytest.fixture(scope="module")
def sandbox():
    """The default sandbox: (config, world, suites)."""
    return make_sandbox()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sandbox):
    """The embedded tiny model (untrained), its tokenizer trained on the sandbox's text."""
    cfg, world, suites = sandbox
    return tiny_on_sandbox(tmp_path_factory.mktemp("m") / "tiny", cfg, world, suites, n_demos=60)
