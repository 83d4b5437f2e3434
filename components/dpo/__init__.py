"""DPO from A/B data: A/B logs (S3, or simulated in the sandbox) -> preference pairs -> DPO."""

from components.core.phase import PhaseResult
from components.dpo.recipe import run

__all__ = ["PhaseResult", "run"]
