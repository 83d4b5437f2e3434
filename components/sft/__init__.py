"""SFT warmup on expert agent trajectories (loss on the agent's own tokens only)."""

from components.sft.trainer import SFTResult, run, train_sft

__all__ = ["SFTResult", "run", "train_sft"]
