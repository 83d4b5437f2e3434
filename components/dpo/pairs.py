"""A/B logs -> preference pairs.

Sources (each pair records which one made it):
- `ab`: for one request, a thumbs-up answer over a thumbs-down answer of the other variant. The prompt is
  the longest common prefix of the two conversations (system, request, and any identical turns); chosen
  and rejected are the two continuations (multi-turn: agent turns with the observations between them —
  the loss falls on agent tokens only, see recipe.py).
- `ab` with a correction: the reply the user wrote over the agent's reply at that turn.
- `step` (optional): the same prefix, only the first diverging agent turn of each side.
- `rollout` (optional, AgentQ-style): the best vs the worst trajectory of a group of rollouts.

Filters, each counted: requests whose two answers got the same thumb, or whose answers are identical
while the thumbs disagree (inconsistent feedback); chosen == rejected; a side longer than
`max_pair_chars` or a length ratio above `max_length_ratio`; exact duplicates.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from components.core.config import DPOConfig
from components.core.schema import ABRecord, PreferencePair, Trajectory, read_jsonl

Messages = list[dict[str, str]]


def messages(traj: Trajectory) -> Messages:
    return [{"role": t.role, "content": t.text} for t in traj.turns]


def read_ab_logs(uri: str, skip_invalid: bool = False) -> tuple[list[ABRecord], dict[str, int | list[str]]]:
    """Every ABRecord under `uri` (file, directory or s3:// prefix, many files). A malformed line raises
    SchemaError naming file:line, or with `skip_invalid` is skipped and counted."""
    reader = read_jsonl(uri, ABRecord, skip_invalid=skip_invalid)
    records = list(reader)
    return records, {"read": reader.report.read, "skipped": reader.report.skipped, "errors": reader.report.errors}


def _common_prefix(a: Messages, b: Messages) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    # the completion must start with an agent turn: back off to the last non-assistant message
    while n > 0 and a[n - 1]["role"] == "assistant":
        n -= 1
    return n


def _side_len(msgs: Messages) -> int:
    return sum(len(m["content"]) for m in msgs)


class PairBuilder:
    """Collects pairs through the filters; `stats` counts what each filter dropped."""

    def __init__(self, cfg: DPOConfig) -> None:
        self.cfg = cfg
        self.pairs: list[PreferencePair] = []
        self.stats: Counter[str] = Counter()
        self._seen: set[str] = set()

    def add(self, prompt: Messages, chosen: Messages, rejected: Messages, source: str, task_id: str,
            **meta) -> bool:
        if not chosen or not rejected or chosen == rejected:
            self.stats["dropped_identical"] += 1
            return False
        if chosen[0]["role"] != "assistant" or rejected[0]["role"] != "assistant":
            self.stats["dropped_not_agent_turn"] += 1
            return False
        lc, lr = _side_len(chosen), _side_len(rejected)
        if max(lc, lr) > self.cfg.max_pair_chars:
            self.stats["dropped_too_long"] += 1
            return False
        if max(lc, lr) > self.cfg.max_length_ratio * max(1, min(lc, lr)):
            self.stats["dropped_length_ratio"] += 1
            return False
        key = hashlib.sha256(json.dumps([prompt, chosen, rejected], sort_keys=True).encode()).hexdigest()
        if key in self._seen:
            self.stats["dropped_duplicate"] += 1
            return False
        self._seen.add(key)
        self.pairs.append(PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected, source=source,
                                         task_id=task_id, meta=meta))
        self.stats[f"pairs_{source}"] += 1
        return True


def _correction_pair(b: PairBuilder, rec: ABRecord) -> None:
    fb = rec.feedback
    msgs = messages(rec.trajectory)
    agent = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    turn = fb.correction_turn if fb.correction_turn is not None else (agent[0] if agent else -1)
    if turn not in agent:
        b.stats["dropped_bad_correction_turn"] += 1
        return
    b.add(msgs[:turn], [{"role": "assistant", "content": fb.correction or ""}], [msgs[turn]], "ab", rec.task_id,
          request_id=rec.request_id, kind="correction")


def pairs_from_ab(records: Sequence[ABRecord], cfg: DPOConfig) -> PairBuilder:
    b = PairBuilder(cfg)
    by_request: dict[str, list[ABRecord]] = defaultdict(list)
    for r in records:
        by_request[r.request_id].append(r)
        if r.feedback.correction:
            _correction_pair(b, r)
    for rid, recs in sorted(by_request.items()):
        ups = [r for r in recs if r.feedback.thumb == "up"]
        downs = [r for r in recs if r.feedback.thumb == "down"]
        if not ups or not downs:
            b.stats["requests_without_contrast"] += 1
            continue
        for up in ups:
            for down in downs:
                if up.variant == down.variant:
                    continue
                mu, md = messages(up.trajectory), messages(down.trajectory)
                if mu == md:
                    b.stats["dropped_inconsistent"] += 1  # the same answer got both thumbs
                    continue
                n = _common_prefix(mu, md)
                if n == 0:
                    b.stats["dropped_no_common_prompt"] += 1
                    continue
                b.add(mu[:n], mu[n:], md[n:], "ab", up.task_id, request_id=rid, kind="thumbs",
                      chosen_variant=up.variant)
                if cfg.step_pairs:
                    b.add(mu[:n], mu[n:n + 1], md[n:n + 1], "step", up.task_id, request_id=rid)
    return b


def pairs_from_rollouts(b: PairBuilder, trajectories: Iterable[Trajectory]) -> PairBuilder:
    """AgentQ-style: per task, the best vs the worst of its group of rollouts (distinct outcomes only)."""
    from components.core.buffer import TrajectoryBuffer

    for task_id, (best, worst) in sorted(TrajectoryBuffer(trajectories).best_and_worst().items()):
        mb, mw = messages(best), messages(worst)
        n = _common_prefix(mb, mw)
        if n:
            b.add(mb[:n], mb[n:], mw[n:], "rollout", task_id)
    return b


def split_pairs(pairs: Sequence[PreferencePair], heldout_fraction: float, seed: int
                ) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Held-out pairs by task (a task's pairs are all on one side), chosen by a hash of the task id."""
    def held(task_id: str) -> bool:
        h = int(hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return h < heldout_fraction

    train = [p for p in pairs if not held(p.task_id)]
    test = [p for p in pairs if held(p.task_id)]
    return train, test
