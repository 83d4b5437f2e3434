"""The workspace sandbox (mail, files, calendar, chat) and the `sandbox_build` phase."""

from components.sandbox.build import BuildResult, run

__all__ = ["BuildResult", "run"]
