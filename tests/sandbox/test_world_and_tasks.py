from __future__ import annotations

import hashlib
import json

import pytest

from components.core.config import SandboxConfig
from components.core.schema import to_record
from components.sandbox.tasks import FAMILIES, SUITE_FAMILIES, generate_tasks
from components.sandbox.world import World, generate_world


def task_digest(suites) -> str:
    h = hashlib.sha256()
    for name in sorted(suites):
        for t in suites[name]:
            h.update(json.dumps(to_record(t), sort_keys=True).encode())
    return h.hexdigest()


def test_same_seed_same_bytes_other_seed_different():
    a, b, c = (generate_world(SandboxConfig(seed=s)) for s in (3, 3, 4))
    assert a.to_json() == b.to_json() and a.digest() == b.digest()
    assert a.digest() != c.digest()
    ta, tb, tc = (generate_tasks(w, SandboxConfig(seed=s)) for w, s in ((a, 3), (b, 3), (c, 4)))
    assert task_digest(ta) == task_digest(tb) != task_digest(tc)


def test_world_roundtrips_through_json():
    w = generate_world(SandboxConfig(seed=1))
    assert World.from_dict(json.loads(w.to_json())).digest() == w.digest()


def test_world_sizes_follow_the_config_and_ids_are_short():
    cfg = SandboxConfig(num_users=3, emails_per_user=20, files_per_user=5, events_per_user=4, channels_per_user=2)
    w = generate_world(cfg)
    assert len(w.users) == 3 and len(w.mail) == 60 and len(w.channels) == 6
    assert max(len(i) for i in [*w.mail, *w.files, *w.events, *w.channels]) <= 4


def test_h100_world_is_large():
    from components.core.config import load_config

    cfg = load_config(preset="h100", set_pairs=["model.base_uri=/m", "sandbox.num_users=2"]).sandbox
    w = generate_world(cfg)
    per_user = {u: sum(1 for m in w.mail.values() if m["owner"] == u) for u in w.users}
    assert min(per_user.values()) >= 500
    assert min(sum(1 for f in w.files.values() if f["owner"] == u) for u in w.users) >= 20
    assert min(sum(1 for e in w.events.values() if e["owner"] == u) for u in w.users) >= 20
    assert min(sum(1 for c in w.channels.values() if c["owner"] == u) for u in w.users) >= 8
    assert len({m["thread"] for m in w.mail.values()}) < len(w.mail)  # threads group messages


def test_l5_tasks_take_ten_or_more_steps(suites):
    l5 = [t for t in suites["train"] + suites["hard"] if t.level == 5]
    assert l5 and min(len(t.solution["steps"]) for t in l5) >= 10


def test_suites_levels_and_families(suites):
    assert set(suites) == {"train", "easy", "hard", "safety", "robustness", "practice"}
    for suite, fams in SUITE_FAMILIES.items():
        assert {t.tags[0] for t in suites[suite]} <= set(fams), suite
        assert len(suites[suite]) >= 20
    assert {t.level for t in suites["easy"]} <= {1, 2}
    assert {t.level for t in suites["hard"]} <= {3, 4, 5}
    assert {t.level for t in suites["train"]} == {1, 2, 3, 4, 5}
    assert {t.tags[0] for t in suites["train"]} == set(FAMILIES)
    for tasks in suites.values():
        for t in tasks:
            assert t.subgoals and t.solution["steps"] and t.scenario_id.startswith(t.tags[0] + ":")


def test_heldout_suites_share_no_instance_with_train(suites):
    train = {tuple(t.solution["key"]) for t in suites["train"]}
    for name in ("easy", "hard", "safety", "robustness"):
        held = {tuple(t.solution["key"]) for t in suites[name]}
        assert not train & held, name
    ids = [t.id for ts in suites.values() for t in ts]
    assert len(ids) == len(set(ids))


def test_practice_holds_train_pool_instances_no_demo_shows(suites, world, cfg):
    keys = {name: {tuple(t.solution["key"]) for t in ts} for name, ts in suites.items()}
    assert len(keys["practice"]) == len(suites["practice"]) >= 300
    for name in ("train", "easy", "hard", "safety", "robustness"):
        assert not keys["practice"] & keys[name], name  # neither a demo's task nor a held-out one
    assert {t.suite for t in suites["practice"]} == {"practice"}
    # the practice suite is drawn last: without it every other suite is the same, instance for instance
    without = generate_tasks(world, cfg.model_copy(update={"practice_tasks_per_level": 0}))
    assert without["practice"] == [] and task_digest({k: v for k, v in suites.items() if k != "practice"}) == \
        task_digest({k: v for k, v in without.items() if k != "practice"})


@pytest.fixture(scope="module")
def small_world(cfg):
    """The world of the first round's default (6 users): its L3-L5 pools are small enough for the demos to take."""
    small = cfg.model_copy(update={"num_users": 6})
    return generate_world(small), small


def test_default_world_leaves_practice_at_every_level(suites, cfg, world):
    from collections import Counter

    practice, train = Counter(t.level for t in suites["practice"]), Counter(t.level for t in suites["train"])
    assert cfg.practice_reserve > 0 and set(practice) == {1, 2, 3, 4, 5}
    assert min(practice.values()) >= 10 and min(train.values()) >= 40  # unseen instances and demos at every level
    seen = {tuple(t.solution["key"]) for t in suites["train"]}
    assert not seen & {tuple(t.solution["key"]) for t in suites["practice"]}
    # by level (the default), a level's small families all go to the demos: the hard suite's mail_to_event and
    # report have no practice instance; by family, every family has, and the held-out suites are the same
    family = lambda t: t.scenario_id.split(":")[0]  # noqa: E731
    hard = {family(t) for t in suites["hard"]}
    assert {"mail_to_event", "report"} <= hard - {family(t) for t in suites["practice"]}
    fam = generate_tasks(world, cfg.model_copy(update={"practice_reserve_by": "family"}))
    assert {family(t) for t in fam["practice"]} == {family(t) for t in fam["train"]}
    assert all(sum(family(t) == f for t in fam["practice"]) >= 3 for f in hard)
    held = ("easy", "hard", "safety", "robustness")
    assert task_digest({k: suites[k] for k in held}) == task_digest({k: fam[k] for k in held})


def test_practice_reserve_keeps_every_level_out_of_the_demos_and_leaves_heldout_alone(small_world):
    from collections import Counter

    world, cfg = small_world
    cfg = cfg.model_copy(update={"practice_reserve": 0.25})
    suites = generate_tasks(world, cfg)
    practice, train = Counter(t.level for t in suites["practice"]), Counter(t.level for t in suites["train"])
    assert set(practice) == {1, 2, 3, 4, 5}  # the small world's L3-L5 pools are not all demos
    for lv in (3, 4, 5):
        assert practice[lv] >= cfg.practice_reserve * (practice[lv] + train[lv]) - 1
    none = generate_tasks(world, cfg.model_copy(update={"practice_reserve": 0.0}))
    assert not {t.level for t in none["practice"]} & {3, 4, 5}  # without a reserve the demos take them all
    held = ("easy", "hard", "safety", "robustness")
    assert task_digest({k: suites[k] for k in held}) == task_digest({k: none[k] for k in held})
    # where the demos took a level's whole pool (L3-L5 here), the reserve only leaves demos out; where
    # train_tasks_per_level bounds them (L1-L2), a capped family's share goes to the level's other families
    keys = {tuple(t.solution["key"]) for t in none["train"] if t.level >= 3}
    assert {tuple(t.solution["key"]) for t in suites["train"] if t.level >= 3} <= keys


def test_online_tasks_prefer_practice_and_fall_back_per_level(small_world):
    from components.sandbox.suites import Sandbox

    world, cfg = small_world
    box = Sandbox(world, generate_tasks(world, cfg.model_copy(update={"practice_reserve": 0.0})))
    online = box.online_tasks("practice")
    practice_levels = {t.level for t in box.suites["practice"]}
    assert {t.level for t in online} == {1, 2, 3, 4, 5}
    for t in online:  # practice where the level has it, the train suite's tasks only where it has none
        assert (t.suite == "practice") == (t.level in practice_levels)
    assert practice_levels and practice_levels != {1, 2, 3, 4, 5}  # no reserve: the train suite takes L3-L5
    assert box.online_tasks("train") == box.suites["train"]
    reserved = Sandbox(world, generate_tasks(world, cfg.model_copy(update={"practice_reserve": 0.25})))
    assert {t.suite for t in reserved.online_tasks()} == {"practice"}  # a reserve covers every level


def test_scenarios_group_related_tasks(suites):
    from collections import Counter

    counts = Counter(t.scenario_id for t in suites["train"])
    assert sum(1 for c in counts.values() if c >= 2) >= 10  # chains of two tasks of one scenario exist
