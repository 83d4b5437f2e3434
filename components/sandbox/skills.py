"""The skill library (SAGE, Voyager): functions the agent wrote, kept when their task was verified.

A skill is a top-level function over `apis` defined in a code action. It is saved with the task and
scenario it came from once that task is verified successful. Retrieval for a new task: skills of the
same scenario first (SAGE's best setting), then by word n-gram Jaccard similarity of the
instructions; retrieved skills are listed in the prompt and pre-defined in the agent's namespace.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Skill:
    name: str
    source: str
    task_id: str
    scenario_id: str
    instruction: str

    @property
    def signature(self) -> str:
        first = self.source.splitlines()[0] if self.source else f"def {self.name}()"
        return first.rstrip(":").removeprefix("def ").strip()


def ngrams(text: str, n: int = 2) -> set[tuple[str, ...]]:
    words = [w.strip(".,:;!?'\"()").lower() for w in text.split()]
    words = [w for w in words if w]
    grams = {tuple(words[i : i + n]) for i in range(max(0, len(words) - n + 1))}
    return grams | {(w,) for w in words}


def jaccard(a: str, b: str) -> float:
    x, y = ngrams(a), ngrams(b)
    return len(x & y) / len(x | y) if x | y else 0.0


class SkillLibrary:
    def __init__(self, skills: list[Skill] | None = None, max_size: int | None = None) -> None:
        self.skills: list[Skill] = list(skills or [])
        self.max_size = max_size  # a server's cap per session: the oldest skills go first

    def __len__(self) -> int:
        return len(self.skills)

    def add(self, skill: Skill) -> None:
        # the newest definition of a name within a scenario wins
        self.skills = [s for s in self.skills if not (s.name == skill.name and s.scenario_id == skill.scenario_id)]
        self.skills.append(skill)
        if self.max_size is not None and len(self.skills) > self.max_size:
            del self.skills[: len(self.skills) - self.max_size]

    def retrieve(self, scenario_id: str, instruction: str, k: int = 4, mode: str = "scenario") -> list[Skill]:
        """Up to k skills. A skill comes with the other skills saved from the same task (the functions it
        calls), and a group whose names clash with a group already chosen is skipped: what is
        retrieved always runs as it ran when it was verified."""
        if k <= 0:
            return []
        same = [s for s in reversed(self.skills) if s.scenario_id == scenario_id]
        if mode == "scenario" and same:
            candidates = same
        else:
            scored = [(jaccard(s.instruction, instruction), i, s) for i, s in enumerate(self.skills)]
            candidates = [s for score, _, s in sorted(scored, key=lambda x: (-x[0], -x[1])) if score > 0]
        out: dict[str, Skill] = {}
        for s in candidates:
            if s.name in out:
                continue
            group = [g for g in self.skills if g.task_id == s.task_id and g.scenario_id == s.scenario_id]
            if any(g.name in out and out[g.name].task_id != s.task_id for g in group):
                continue
            new = [g for g in group if g.name not in out]
            if len(out) + len(new) > k:
                continue
            for g in new:
                out[g.name] = g
        return list(out.values())

    def to_json(self) -> str:
        return json.dumps([asdict(s) for s in self.skills], sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SkillLibrary:
        return cls([Skill(**d) for d in json.loads(text)])

    def copy(self) -> SkillLibrary:
        return SkillLibrary(list(self.skills), self.max_size)
