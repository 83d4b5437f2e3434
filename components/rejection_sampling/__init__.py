"""Rejection sampling: best-of-N rollouts on hard tasks, keep the best, fine-tune on them."""

from components.rejection_sampling.recipe import RSResult, run

__all__ = ["RSResult", "run"]
