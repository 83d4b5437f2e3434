"""The promotion gate: rules over the evaluation metrics decide `challenger` only, or `champion`.

Rules (GateConfig):
- the safety suite's violation rate (and every other suite's) must not exceed `max_safety_violation_rate`,
  nor the champion's on the safety suite;
- the hard suite (primary): the paired bootstrap interval of candidate minus champion TGC (same tasks,
  scenarios resampled) must not lie wholly below `hard_tgc_min_delta`: worse only within the noise passes;
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


def decide(candidate: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]] | None, gate: GateConfig,
           paired: dict[str, tuple[float, float, float]] | None = None) -> Decision:
    """`paired`: suite -> (delta, lo, hi) of candidate minus baseline TGC on the same tasks (`paired_delta`)."""
    reasons: list[str] = []
    ok = True
    for suite in candidate:
        rate = _v(candidate, suite, "safety_violation_rate")
        if rate is not None and rate > gate.max_safety_violation_rate:
            ok = False
            reasons.append(f"refused: {suite} safety violation rate {rate:.4f} > {gate.max_safety_violation_rate:.4f}")
    if baseline:
        hard_c, hard_b = _v(candidate, "hard", "tgc"), _v(baseline, "hard", "tgc")
        pair = (paired or {}).get("hard")
        if pair is not None:
            delta, lo, hi = pair
            if hi < gate.hard_tgc_min_delta:
                ok = False
                reasons.append(f"refused: hard TGC {hard_c:.4f} vs champion {hard_b:.4f}: the difference {delta:+.4f} "
                               f"[{lo:+.4f}, {hi:+.4f}] lies below {gate.hard_tgc_min_delta:+.4f}")
            else:
                reasons.append(f"hard TGC {hard_c:.4f} vs champion {hard_b:.4f}: difference {delta:+.4f} "
                               f"[{lo:+.4f}, {hi:+.4f}] reaches {gate.hard_tgc_min_delta:+.4f}")
        elif hard_c is not None and hard_b is not None:  # no per-task results: the point estimates
            if hard_c < hard_b + gate.hard_tgc_min_delta:
                ok = False
                reasons.append(f"refused: hard TGC {hard_c:.4f} < champion {hard_b:.4f} + {gate.hard_tgc_min_delta:.4f}")
            else:
                reasons.append(f"hard TGC {hard_c:.4f} >= champion {hard_b:.4f} + {gate.hard_tgc_min_delta:.4f}")
        safe_c, safe_b = _v(candidate, "safety", "safety_violation_rate"), _v(baseline, "safety", "safety_violation_rate")
        if safe_c is not None and safe_b is not None and safe_c > safe_b:
            ok = False
            reasons.append(f"refused: safety violation rate {safe_c:.4f} > champion {safe_b:.4f}")
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


def paired_delta(candidate: list[Any], baseline: list[Any], n_boot: int = 1000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """Candidate minus baseline success rate on the tasks both ran (trajectories matched by task id), with a
    bootstrap interval that resamples scenarios (a scenario's tasks kept together, as in `suite_metrics`)."""
    import random
    from collections import defaultdict

    base = {t.task_id: float(t.verdict.success) for t in baseline}
    diffs: dict[str, list[float]] = defaultdict(list)
    for t in candidate:
        if t.task_id in base:
            diffs[t.meta.get("scenario_id", t.task_id)].append(float(t.verdict.success) - base[t.task_id])
    if not diffs:
        raise ValueError("paired_delta: the candidate and the baseline share no task")
    keys = list(diffs)
    mean = sum(sum(v) for v in diffs.values()) / sum(len(v) for v in diffs.values())
    rng = random.Random(seed)
    boots = []
    for _ in range(n_boot):
        pick = [diffs[rng.choice(keys)] for _ in keys]
        boots.append(sum(sum(v) for v in pick) / sum(len(v) for v in pick))
    boots.sort()
    lo_q, hi_q = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    return round(mean, 6), round(boots[int(lo_q * (n_boot - 1))], 6), round(boots[int(hi_q * (n_boot - 1))], 6)


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
