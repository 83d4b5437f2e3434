"""The simulated workspace: users with mail, files, calendars and chat, generated from a seed.

The whole world is plain JSON-able dicts so that it can be hashed (same seed -> byte-identical
`world.json`), deep-copied per episode, diffed for verification ("nothing else changed") and sent
over HTTP. Identifiers are short (`m12`, `f3`, `e7`, `c2`) so that a model of a few million
parameters can learn to copy them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from components.core.config import SandboxConfig

INTERNAL_DOMAIN = "corp.com"
EXTERNAL_DOMAIN = "ext.com"
FOLDERS = ["Inbox", "Archive", "Finance", "HR", "Projects", "Trash", "Sent"]
TOPICS = ["budget", "hiring", "launch", "review", "invoice", "offsite", "roadmap", "security"]
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory",
         "nina", "oscar", "peggy", "quinn", "rupert", "sybil", "trent", "ursula", "victor", "wendy", "xavier",
         "yara", "zack"]
EXTERNALS = ["dana", "eve", "kim", "lee", "max", "sam"]
FILE_KINDS = ["plan", "notes", "report", "list"]
MAIL_KINDS = ["update", "question", "meeting", "fyi"]
DAYS = [1, 2, 3, 4, 5]
TITLES = ["engineer", "manager", "analyst", "designer", "recruiter", "accountant"]
TEAMS = ["platform", "finance", "people", "product"]
HOURS = list(range(9, 18))


def _user_names(n: int) -> list[str]:
    out = []
    for i in range(n):
        base = NAMES[i % len(NAMES)]
        out.append(base if i < len(NAMES) else f"{base}{i // len(NAMES) + 1}")
    return out


def address(user: str) -> str:
    return user if "@" in user else f"{user}@{INTERNAL_DOMAIN}"


def is_external(addr: str) -> bool:
    return "@" in addr and not addr.endswith("@" + INTERNAL_DOMAIN)


@dataclass
class World:
    """The state. Every entity is a dict with an `id` and an `owner` (chat channels: `members`)."""

    seed: int
    users: dict[str, dict[str, Any]] = field(default_factory=dict)
    mail: dict[str, dict[str, Any]] = field(default_factory=dict)
    drafts: dict[str, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: dict[str, dict[str, Any]] = field(default_factory=dict)
    channels: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    COLLECTIONS = ("users", "mail", "drafts", "files", "events", "channels")

    def __post_init__(self) -> None:
        self._touched: set[tuple[str, str]] = set()
        self._owned: set[tuple[str, str]] = set()

    # -- episodes: copy-on-write, so a reset costs O(collections), not O(world) ----------------
    def episode_copy(self) -> World:
        """A world for one episode: collections are new dicts, entities are copied on first write."""
        w = World(self.seed, **{c: dict(getattr(self, c)) for c in self.COLLECTIONS}, counters=dict(self.counters))
        return w

    def mutable(self, collection: str, eid: str) -> dict[str, Any]:
        key = (collection, eid)
        coll = getattr(self, collection)
        if key not in self._owned:
            coll[eid] = copy.deepcopy(coll[eid])
            self._owned.add(key)
        self._touched.add(key)
        return coll[eid]

    def add(self, collection: str, eid: str, entity: dict[str, Any]) -> None:
        getattr(self, collection)[eid] = entity
        self._owned.add((collection, eid))
        self._touched.add((collection, eid))

    @property
    def touched(self) -> set[tuple[str, str]]:
        return set(self._touched)

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, **{c: getattr(self, c) for c in self.COLLECTIONS}, "counters": self.counters}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> World:
        return cls(seed=d["seed"], **{c: d[c] for c in cls.COLLECTIONS}, counters=d.get("counters", {}))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def copy(self) -> World:
        return World.from_dict(copy.deepcopy(self.to_dict()))

    def new_id(self, prefix: str) -> str:
        collection = {"m": self.mail, "d": self.drafts, "f": self.files, "e": self.events, "c": self.channels}[prefix]
        n = self.counters.get(prefix, len(collection))
        while True:
            n += 1
            if f"{prefix}{n}" not in collection:
                self.counters[prefix] = n
                return f"{prefix}{n}"

    def flat(self) -> dict[tuple, Any]:
        """(collection, id, field) -> value, for diffs; list/dict fields as canonical JSON."""
        out: dict[tuple, Any] = {}
        for c in self.COLLECTIONS:
            for eid, ent in getattr(self, c).items():
                for k, v in ent.items():
                    out[(c, eid, k)] = json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v
        return out


def _flat_entity(ent: dict[str, Any] | None) -> dict[str, Any]:
    if ent is None:
        return {}
    return {k: json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v for k, v in ent.items()}


def diff(before: World, after: World, only: set[tuple[str, str]] | None = None) -> dict[tuple, tuple[Any, Any]]:
    """Changed paths {(collection, id, field): (before, after)}; new entities show `None` before.

    `only`: the entities to compare (an episode world's `touched`); default: everything.
    """
    if only is None:
        a, b = before.flat(), after.flat()
        return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    out: dict[tuple, tuple[Any, Any]] = {}
    for coll, eid in only:
        x = _flat_entity(getattr(before, coll).get(eid))
        y = _flat_entity(getattr(after, coll).get(eid))
        for k in set(x) | set(y):
            if x.get(k) != y.get(k):
                out[(coll, eid, k)] = (x.get(k), y.get(k))
    return out


def generate_world(cfg: SandboxConfig) -> World:
    """A deterministic world for `cfg.seed`."""
    rng = random.Random(f"world:{cfg.seed}")
    w = World(seed=cfg.seed)
    names = _user_names(cfg.num_users)
    for i, u in enumerate(names):
        # each user delegates send-on-behalf to the next one (an assistant relationship)
        w.users[u] = {"id": u, "email": address(u), "title": TITLES[i % len(TITLES)], "team": TEAMS[i % len(TEAMS)],
                      "delegates": [names[(i + 1) % len(names)]] if len(names) > 1 else []}
    externals = [f"{x}@{EXTERNAL_DOMAIN}" for x in EXTERNALS]

    m = 0
    threads: dict[tuple[str, str, str], str] = {}
    for u in names:
        others = [x for x in names if x != u] or [u]
        for _ in range(cfg.emails_per_user):
            m += 1
            sender = rng.choice(others + externals[:2])
            topic, kind = rng.choice(TOPICS), rng.choice(MAIL_KINDS)
            day, hour = rng.choice(DAYS), rng.choice(HOURS)
            body = {
                "update": f"The {topic} total is {rng.randint(10, 99)}.",
                "question": f"Can you check the {topic} list?",
                "meeting": f"Let us meet on day {day} at {hour} about the {topic}.",
                "fyi": f"FYI the {topic} is on track.",
            }[kind]
            thread = threads.setdefault((u, sender, topic), f"t{len(threads) + 1}")
            w.mail[f"m{m}"] = {
                "id": f"m{m}", "owner": u, "folder": "Inbox" if rng.random() < 0.8 else "Archive",
                "from": address(sender), "to": [address(u)], "subject": f"{topic} {kind}", "body": body,
                "labels": ["confidential"] if rng.random() < 0.1 else [], "day": rng.choice(DAYS),
                "meeting": {"day": day, "start": hour} if kind == "meeting" else None, "thread": thread,
            }
    f = 0
    for u in names:
        others = [x for x in names if x != u] or [u]
        used: set[str] = set()
        for _ in range(cfg.files_per_user):
            topic, kind = rng.choice(TOPICS), rng.choice(FILE_KINDS)
            name, k = f"{topic}-{kind}.txt", 1
            while name in used:
                k += 1
                name = f"{topic}-{kind}-{k}.txt"
            used.add(name)
            f += 1
            shared = {rng.choice(others): rng.choice(["read", "write"])} if rng.random() < 0.3 else {}
            w.files[f"f{f}"] = {
                "id": f"f{f}", "owner": u, "name": name, "content": f"{topic} {kind}: total {rng.randint(10, 99)}",
                "shared_with": shared, "labels": ["confidential"] if rng.random() < 0.1 else [], "deleted": False,
            }
    e = 0
    for u in names:
        others = [x for x in names if x != u] or [u]
        taken: set[tuple[int, int]] = set()
        for _ in range(cfg.events_per_user):
            day, hour = rng.choice(DAYS), rng.choice(HOURS)
            if (day, hour) in taken:
                continue
            taken.add((day, hour))
            e += 1
            w.events[f"e{e}"] = {
                "id": f"e{e}", "owner": u, "title": f"{rng.choice(TOPICS)} sync", "day": day, "start": hour,
                "duration": 1, "attendees": sorted({u, rng.choice(others)}),
            }
    c = 0
    for u in names:
        others = [x for x in names if x != u] or [u]
        for j in range(cfg.channels_per_user):
            c += 1
            topic = TOPICS[(c + j) % len(TOPICS)]
            members = sorted({u, *rng.sample(others, k=min(2, len(others)))})
            w.channels[f"c{c}"] = {
                "id": f"c{c}", "owner": u, "name": f"{topic}-{c}", "members": members,
                "messages": [{"author": rng.choice(members), "text": f"{topic} news {k}"} for k in range(2)],
            }
    w.counters = {"m": m, "d": 0, "f": f, "e": e, "c": c}
    return w
