"""The workspace sandbox (mail, files, calendar, chat) and the `sandbox_build` phase."""

from components.sandbox.recipe import BuildResult, run

__all__ = ["BuildResult", "run"]
