"""The curriculum of the seed recipe: start easy, move up a level when the current one is mastered.

Stages are indexed by the *frontier* (the highest level in the mix). The first stage's mix is
`start_mix` (80 % L1-L2, 20 % L3 by default), the last one (frontier 5) is `final_mix`; stages in
between blend the two over the levels they allow. Level 1 counts as "easy" and is clamped into
[easy_fraction_min, easy_fraction_max] in every stage after the first, so easy tasks never vanish.
The frontier moves up when the success rate over the last `window` episodes at the frontier level
exceeds `promote_threshold`. The state is a small dict, saved in every checkpoint.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from components.core.config import CurriculumConfig
from components.core.env import by_family
from components.core.schema import Task

MAX_LEVEL = 5


def _normalise(mix: dict[int, float]) -> dict[int, float]:
    total = sum(w for w in mix.values() if w > 0)
    if total <= 0:
        raise ValueError(f"grpo.curriculum: a level mix with no positive weight: {mix}")
    return {lv: w / total for lv, w in sorted(mix.items()) if w > 0}


@dataclass
class Curriculum:
    cfg: CurriculumConfig
    frontier: int = 0
    history: dict[int, deque] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.frontier:
            self.frontier = max(lv for lv, w in self.cfg.start_mix.items() if w > 0)
        self.first = self.frontier

    # -- the mix -------------------------------------------------------------------------------
    def mix(self) -> dict[int, float]:
        start, final = _normalise(self.cfg.start_mix), _normalise(self.cfg.final_mix)
        if self.frontier <= self.first:
            return start
        if self.frontier >= MAX_LEVEL:
            return final
        t = (self.frontier - self.first) / (MAX_LEVEL - self.first)
        blend = {lv: (1 - t) * start.get(lv, 0.0) + t * final.get(lv, 0.0) for lv in range(1, self.frontier + 1)}
        blend[self.frontier] = max(blend[self.frontier], final.get(self.frontier, 0.0), 0.1)  # the new level shows up
        blend = _normalise(blend)
        easy = min(max(blend.get(1, 0.0), self.cfg.easy_fraction_min), self.cfg.easy_fraction_max)
        rest = _normalise({lv: w for lv, w in blend.items() if lv != 1} or {self.frontier: 1.0})
        return _normalise({1: easy, **{lv: (1 - easy) * w for lv, w in rest.items()}})

    def sample(self, pool: dict[int, list[Task]], n: int, rng: random.Random) -> list[Task]:
        """`n` tasks drawn by the current mix (levels missing from the pool are skipped)."""
        mix = {lv: w for lv, w in self.mix().items() if pool.get(lv)}
        if not mix:
            raise ValueError("grpo.curriculum: no train task at any level of the current mix")
        levels = sorted(mix)
        weights = [mix[lv] for lv in levels]
        picked = rng.choices(levels, weights=weights, k=n)
        if self.cfg.balance == "task":
            return [rng.choice(pool[lv]) for lv in picked]
        families = {lv: list(by_family(pool[lv]).values()) for lv in set(picked)}
        return [rng.choice(rng.choice(families[lv])) for lv in picked]

    # -- progress ------------------------------------------------------------------------------
    def record(self, level: int, success: bool) -> None:
        self.history.setdefault(level, deque(maxlen=self.cfg.window)).append(bool(success))

    def success(self, level: int) -> float | None:
        h = self.history.get(level)
        return sum(h) / len(h) if h else None

    def update(self) -> bool:
        """Move the frontier up when it is mastered; True when it moved."""
        h = self.history.get(self.frontier)
        if self.frontier < MAX_LEVEL and h and len(h) >= min(self.cfg.window, 8) and \
                sum(h) / len(h) > self.cfg.promote_threshold:
            self.frontier += 1
            return True
        return False

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"frontier": self.frontier, "first": self.first,
                "history": {str(lv): [int(x) for x in h] for lv, h in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.frontier, self.first = int(state["frontier"]), int(state["first"])
        self.history = {int(lv): deque((bool(x) for x in h), maxlen=self.cfg.window)
                        for lv, h in state["history"].items()}
