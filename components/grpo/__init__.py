"""GRPO for multi-turn agents: SAGE chains, curriculum, collapse monitor with SFT repair, exact resume."""

from components.core.phase import PhaseResult
from components.grpo.recipe import launch, run

__all__ = ["PhaseResult", "run", "launch"]
