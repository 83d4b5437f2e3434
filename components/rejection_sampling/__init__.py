"""Rejection sampling: best-of-N rollouts on hard tasks, keep the best, fine-tune on them."""

from components.core.phase import PhaseResult
from components.rejection_sampling.recipe import run

__all__ = ["PhaseResult", "run"]
