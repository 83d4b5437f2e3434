"""SFT warmup on expert agent trajectories (loss on the agent's own tokens only)."""

from components.core.phase import PhaseResult
from components.sft.recipe import launch, run

__all__ = ["PhaseResult", "run", "launch"]
