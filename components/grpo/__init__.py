"""GRPO for multi-turn agents: SAGE chains, curriculum, collapse monitor with SFT repair, exact resume."""

from components.grpo.trainer import GRPOResult, run

__all__ = ["GRPOResult", "run"]
