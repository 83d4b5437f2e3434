"""prepare: resolve and validate the pipeline config, bring the base model in, open the parent run."""

from components.prepare.build import PrepareResult, run

__all__ = ["PrepareResult", "run"]
