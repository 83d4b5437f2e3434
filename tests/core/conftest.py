"""Fixtures of the runtime tests: the default sandbox and the embedded tiny model on its text (one per module)."""

from tests.helpers.fixtures import sandbox, tiny  # noqa: F401
