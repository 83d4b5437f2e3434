"""DPO from A/B data: A/B logs (S3, or simulated in the sandbox) -> preference pairs -> DPO."""

from components.dpo.trainer import DPOResult, run

__all__ = ["DPOResult", "run"]
