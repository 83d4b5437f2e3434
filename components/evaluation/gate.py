"""The promotion gate: rules over the evaluation metrics decide `challenger` only, or `champion`.

Rules (GateConfig):
- the safety suite's violation rate (and every other suite's) must not exceed `max_safety_violation_rate`;
- hard TGC must reach the champion's + `hard_tgc_min_delta`;
- no suite's TGC may drop more than `max_suite_regression` below the champion's.
Without a champion, the safety rule alone decides (the first model that is safe becomes champion).
Every candidate is registered and gets the `challenger` alias; `champion` moves only on promotion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from components.core.config import GateConfig


@dataclass
class Decision:
    promote: bool
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"promote": self.promote, "reasons": self.reasons}


def _v(metrics: dict[str, dict[str, Any]], suite: str, name: str) -> float | None:
    m = metrics.get(suite, {}).get(name)
    return None if m is None else float(m["value"])


def decide(candidate: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]] | None, gate: GateConfig) -> Decision:
    reasons: list[str] = []
    ok = True
    for suite in candidate:
        rate = _v(candidate, suite, "safety_violation_rate")
        if rate is not None and rate > gate.max_safety_violation_rate:
            ok = False
            reasons.append(f"refused: {suite} safety violation rate {rate:.4f} > {gate.max_safety_violation_rate:.4f}")
    if baseline:
        hard_c, hard_b = _v(candidate, "hard", "tgc"), _v(baseline, "hard", "tgc")
        if hard_c is not None and hard_b is not None:
            if hard_c < hard_b + gate.hard_tgc_min_delta:
                ok = False
                reasons.append(f"refused: hard TGC {hard_c:.4f} < champion {hard_b:.4f} + {gate.hard_tgc_min_delta:.4f}")
            else:
                reasons.append(f"hard TGC {hard_c:.4f} >= champion {hard_b:.4f} + {gate.hard_tgc_min_delta:.4f}")
        for suite in candidate:
            c, b = _v(candidate, suite, "tgc"), _v(baseline, suite, "tgc")
            if c is not None and b is not None and c < b - gate.max_suite_regression:
                ok = False
                reasons.append(f"refused: {suite} TGC {c:.4f} regresses more than {gate.max_suite_regression:.4f} "
                               f"below champion {b:.4f}")
    else:
        reasons.append("no champion yet: the safety rule decides")
    if ok:
        reasons.append("promoted to champion")
    return Decision(ok, reasons)


def deltas(candidate: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]] | None) -> dict[str, float]:
    """Per-suite, per-metric candidate minus baseline."""
    if not baseline:
        return {}
    out = {}
    for suite, ms in candidate.items():
        for name, m in ms.items():
            b = _v(baseline, suite, name)
            if b is not None:
                out[f"{suite}/{name}"] = round(float(m["value"]) - b, 6)
    return out
