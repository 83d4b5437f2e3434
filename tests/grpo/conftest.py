from __future__ import annotations

import pytest

from tests.helpers.runtime import make_sandbox, tiny_on_sandbox


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The embedded tiny model (untrained), its tokenizer trained on the default sandbox's text."""
    cfg, world, suites = make_sandbox()
    return tiny_on_sandbox(tmp_path_factory.mktemp("grpo-tiny") / "tiny", cfg, world, suites, n_demos=20)
