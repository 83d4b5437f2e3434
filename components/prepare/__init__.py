"""prepare: resolve and validate the pipeline config, bring the base model in, open the parent run."""

from components.core.phase import PhaseResult
from components.prepare.recipe import run

__all__ = ["PhaseResult", "run"]
