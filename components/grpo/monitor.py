"""The RL-collapse monitor of seed 004: cheap signals every step, alarms when one crosses its line.

Signals (each logged as `grpo/monitor/<name>`):
- `control_prob_ratio`: mean probability the policy gives its own control tokens (end of turn, the
  action opener `{` / ```` ``` ````) at the positions where it emitted them, over the SFT model's
  probability at the same positions (the reference model when beta > 0, else the policy at step 0,
  which *is* the SFT model). Collapse shows here first: the format falls apart before the reward.
- `format_error_rate`: malformed actions / agent turns, from the environment.
- `entropy`: mean token entropy on agent tokens; the alarm compares it with the incoming policy's (the
  first measurement), as the control-token probability is compared with the SFT model's.
- `kl`: mean k3 KL to the reference.
- `zero_variance_groups`: fraction of groups whose samples all scored the same (no signal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from components.core.config import CollapseMonitorConfig


def control_token_ids(tokenizer: Any, action_format: str) -> set[int]:
    """End of turn plus the first token of the action opener of the configured format."""
    ids = {tokenizer.eos_token_id}
    opener = "```" if action_format == "code" else '{"tool"'
    for text in (opener, " " + opener, "\n" + opener):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if enc:
            ids.add(enc[0] if text == opener else enc[1] if len(enc) > 1 else enc[0])
    return {i for i in ids if i is not None}


@dataclass
class CollapseMonitor:
    cfg: CollapseMonitorConfig
    baseline_control_prob: float | None = None  # the SFT model's, when no reference model is loaded
    baseline_entropy: float | None = None  # the incoming policy's: the first measurement
    alarms_total: dict[str, int] = field(default_factory=dict)

    def check(self, signals: dict[str, float]) -> list[str]:
        """The names of the alarms these signals raise."""
        out = []
        ratio = signals.get("control_prob_ratio")
        if ratio is not None and ratio < self.cfg.control_prob_drop:
            out.append("control_prob")
        if signals.get("format_error_rate", 0.0) > self.cfg.max_format_error_rate:
            out.append("format_error")
        if "entropy" in signals:
            if self.baseline_entropy is None:
                self.baseline_entropy = signals["entropy"]
            if signals["entropy"] < self.cfg.entropy_drop * self.baseline_entropy:
                out.append("entropy")
        if signals.get("kl", 0.0) > self.cfg.max_kl:
            out.append("kl")
        if signals.get("zero_variance_groups", 0.0) > self.cfg.max_zero_variance_groups:
            out.append("zero_variance")
        for name in out:
            self.alarms_total[name] = self.alarms_total.get(name, 0) + 1
        return out

    def control_ratio(self, policy_prob: float | None, reference_prob: float | None) -> float | None:
        """policy / reference; without a reference the first measurement becomes the baseline."""
        if policy_prob is None:
            return None
        if reference_prob is None:
            if self.baseline_control_prob is None:
                self.baseline_control_prob = policy_prob
            reference_prob = self.baseline_control_prob
        return policy_prob / max(reference_prob, 1e-12)

    def state_dict(self) -> dict:
        return {"baseline_control_prob": self.baseline_control_prob, "baseline_entropy": self.baseline_entropy,
                "alarms_total": dict(self.alarms_total)}

    def load_state_dict(self, state: dict) -> None:
        self.baseline_control_prob = state.get("baseline_control_prob")
        self.baseline_entropy = state.get("baseline_entropy")
        self.alarms_total = dict(state.get("alarms_total", {}))
