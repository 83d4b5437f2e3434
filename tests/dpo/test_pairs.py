"""A/B logs -> preference pairs: strict and skipping readers, the pair rules and filters, agent-token masks."""

from __future__ import annotations

import json

import pytest

from components.core.config import DPOConfig, TinyModelConfig
from components.core.policy import load_policy
from components.core.schema import (
    ABRecord,
    Feedback,
    RewardBreakdown,
    SchemaError,
    Trajectory,
    Turn,
    Verdict,
    to_record,
    write_jsonl,
)
from components.core.tiny import build_tiny_model
from components.dpo.pairs import pairs_from_ab, read_ab_logs, split_pairs
from components.dpo.recipe import _trainer_classes, tokenize_pair
from components.dpo.simulator import expert_correction

SYSTEM = {"role": "system", "text": "You are alice's assistant."}


def traj(task: str, *agent_and_obs: str, success: bool = False) -> Trajectory:
    turns = [Turn(**SYSTEM), Turn(role="user", text=f"Do {task}.")]
    for i, text in enumerate(agent_and_obs):
        turns.append(Turn(role="assistant" if i % 2 == 0 else "tool", text=text))
    return Trajectory(task_id=task, policy="p", turns=turns, verdict=Verdict(success=success),
                      reward=RewardBreakdown(total=float(success)))


def rec(rid: str, variant: str, t: Trajectory, thumb=None, correction=None, turn=None) -> ABRecord:
    return ABRecord(request_id=rid, task_id=t.task_id, variant=variant, model_id=f"model-{variant}", trajectory=t,
                    feedback=Feedback(thumb=thumb, correction=correction, correction_turn=turn))


GOOD = ('{"tool": "mail.move", "args": {"ids": ["m1"]}}', '{"ok":true}', '{"tool": "finish", "args": {}}', '{"ok":true}')
BAD = ('{"tool": "mail.move", "args": {"ids": ["m9"]}}', '{"ok":false}', '{"tool": "finish", "args": {}}', '{"ok":true}')


def test_strict_reader_names_file_and_line_and_skipping_counts(tmp_path):
    good = [rec(f"r{i}", "A", traj(f"t{i}", *GOOD), "up") for i in range(3)]
    write_jsonl(tmp_path / "logs" / "a.jsonl", good)
    lines = [json.dumps(to_record(r)) for r in good]
    broken = dict(to_record(good[0]), variant="C")
    (tmp_path / "logs" / "b.jsonl").write_text("\n".join([lines[0], lines[1], '{"schema": "agentrl/ab/v1", "req',
                                                          json.dumps(broken), lines[2]]) + "\n")
    with pytest.raises(SchemaError, match=r"b\.jsonl:3: not valid JSON"):
        read_ab_logs(str(tmp_path / "logs"))
    records, report = read_ab_logs(str(tmp_path / "logs"), skip_invalid=True)
    assert len(records) == 6 and report["read"] == 6 and report["skipped"] == 2
    assert any("b.jsonl:4" in e and "variant" in e for e in report["errors"])


@pytest.mark.parametrize("line,reason", [
    (b'{"schema": "agentrl/ab/v1", "request_id": "\xff\xfe"}', "not UTF-8 text (byte 43)"),
    (b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply"),
    (b'{"schema": "agentrl/ab/v1", "request_id": "\\ud800"}', "lone surrogate"),
    (b'{"schema": "agentrl/ab/v1", "request_id": ' + b"9" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
    (b"[1, 2]", "expected"),
    (b'"just text"', "expected"),
])
def test_hostile_lines_are_errors_naming_file_and_line_and_skipping_counts_them(tmp_path, line, reason):
    good = json.dumps(to_record(rec("r0", "A", traj("t0", *GOOD), "up"))).encode()
    f = tmp_path / "ab.jsonl"
    f.write_bytes(b"\n".join([good, line, good.replace(b'"r0"', b'"r1"')]) + b"\n")
    with pytest.raises(SchemaError) as err:
        read_ab_logs(str(f))
    assert str(err.value).startswith(f"{f}:2: ") and reason in str(err.value)
    records, report = read_ab_logs(str(f), skip_invalid=True)
    assert [r.request_id for r in records] == ["r0", "r1"] and report["skipped"] == 1
    assert report["errors"][0].startswith(f"{f}:2: ")


def test_reads_many_files_from_s3(tmp_path, bucket):
    from components.core import storage

    for k in range(2):
        write_jsonl(f"s3://{bucket}/ab/day{k}.jsonl", [rec(f"r{k}", "A", traj("t", *GOOD), "up")])
    records, report = read_ab_logs(f"s3://{bucket}/ab/")
    assert sorted(r.request_id for r in records) == ["r0", "r1"] and report["skipped"] == 0
    assert storage.exists(f"s3://{bucket}/ab/day0.jsonl")


def test_pairs_thumbs_corrections_and_filters():
    cfg = DPOConfig(max_length_ratio=3.0)
    records = [
        rec("r1", "A", traj("t1", *GOOD, success=True), "up"), rec("r1", "B", traj("t1", *BAD), "down"),
        rec("r2", "A", traj("t2", *BAD), "down"), rec("r2", "B", traj("t2", *BAD), "down"),  # no contrast
        rec("r3", "A", traj("t3", *GOOD), "up"), rec("r3", "B", traj("t3", *GOOD), "down"),  # inconsistent
        rec("r4", "A", traj("t1", *GOOD, success=True), "up"), rec("r4", "B", traj("t1", *BAD), "down"),  # duplicate
        rec("r5", "A", traj("t5", *BAD), "down", correction=GOOD[0], turn=2),
        rec("r6", "A", traj("t6", "x" * 50, *GOOD[1:]), "up"), rec("r6", "B", traj("t6", "y" * 5000, *GOOD[1:]), "down"),
        rec("r7", "A", traj("t7", *BAD), "down", correction="ok", turn=3),  # turn 3 is an observation
    ]
    b = pairs_from_ab(records, cfg)
    kinds = sorted(p.meta["kind"] for p in b.pairs)
    assert kinds == ["correction", "thumbs"], b.stats
    thumbs = next(p for p in b.pairs if p.meta["kind"] == "thumbs")
    assert [m["role"] for m in thumbs.prompt] == ["system", "user"]
    assert thumbs.chosen[0] == {"role": "assistant", "content": GOOD[0]}
    assert thumbs.rejected[0] == {"role": "assistant", "content": BAD[0]}
    assert [m["role"] for m in thumbs.chosen] == ["assistant", "tool", "assistant", "tool"]
    corr = next(p for p in b.pairs if p.meta["kind"] == "correction")
    assert corr.chosen == [{"role": "assistant", "content": GOOD[0]}] and corr.rejected[0]["content"] == BAD[0]
    assert b.stats["requests_without_contrast"] == 3  # r2, r5, r7
    assert b.stats["dropped_inconsistent"] == 1 and b.stats["dropped_duplicate"] == 1
    assert b.stats["dropped_length_ratio"] == 1 and b.stats["dropped_bad_correction_turn"] == 1
    step = pairs_from_ab(records[:2], DPOConfig(step_pairs=True))
    assert [p.source for p in step.pairs] == ["ab", "step"] and len(step.pairs[1].chosen) == 1


def test_split_keeps_a_task_on_one_side():
    records = []
    for i in range(40):
        records += [rec(f"r{i}", "A", traj(f"t{i % 10}", *GOOD, f"{i}"), "up"), rec(f"r{i}", "B", traj(f"t{i % 10}", *BAD), "down")]
    pairs = pairs_from_ab(records, DPOConfig()).pairs
    train, test = split_pairs(pairs, 0.3, seed=0)
    assert train and test and not {p.task_id for p in train} & {p.task_id for p in test}


def test_expert_correction_points_at_the_first_divergent_agent_turn():
    e = traj("t", *GOOD)
    assert expert_correction(traj("t", *BAD), e) == (2, GOOD[0])
    assert expert_correction(traj("t", GOOD[0], GOOD[1], "finish now"), e) == (4, GOOD[2])
    assert expert_correction(e, e) is None


def test_simulated_requests_follow_the_suite_and_levels():
    import random

    from components.core.config import ABSimulatorConfig
    from components.core.schema import Task, Verifier
    from components.dpo.simulator import draw_requests
    from components.sandbox.suites import Sandbox

    def task(i: int, level: int, suite: str) -> Task:
        return Task(id=f"{suite}-{i}", scenario_id="s", level=level, suite=suite, instruction=f"do {i}", user_id="u",
                    verifier=Verifier("state", {}))

    practice = [task(i, 1 + i % 3, "practice") for i in range(30)]
    train = [task(i, 1 + i % 5, "train") for i in range(50)]
    box = Sandbox(world=None, suites={"practice": practice, "train": train})
    every = draw_requests(box, ABSimulatorConfig(requests=40), random.Random(0))
    assert len(every) == 40 and {t.level for t in every} == {1, 2, 3, 4, 5}  # L4-L5 from train: practice lacks them
    assert len({t.id for t in every}) == 40  # 80 tasks in the pool: none drawn twice
    hard = draw_requests(box, ABSimulatorConfig(requests=40, levels=[3, 4, 5]), random.Random(0))
    assert len(hard) == 40 and {t.level for t in hard} == {3, 4, 5}
    assert {t.suite for t in hard if t.level == 3} == {"practice"} and {t.suite for t in hard if t.level > 3} == {"train"}
    with pytest.raises(ValueError, match=r"levels=\[5\]: the sandbox has no tasks there"):
        draw_requests(Sandbox(world=None, suites={"practice": practice, "train": []}), ABSimulatorConfig(levels=[5]),
                      random.Random(0))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_policy(str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(pretrain_steps=0)))).tokenizer


def test_agent_mask_covers_agent_tokens_only(tokenizer):
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Do it."}]
    chosen = [{"role": "assistant", "content": GOOD[0]}, {"role": "tool", "content": "OBSERVATION"},
              {"role": "assistant", "content": GOOD[2]}]
    rejected = [{"role": "assistant", "content": BAD[0]}]
    ex = tokenize_pair(tokenizer, prompt, chosen, rejected)
    agent = tokenizer.decode([i for i, m in zip(ex["chosen_ids"], ex["chosen_mask"], strict=True) if m])
    other = tokenizer.decode([i for i, m in zip(ex["chosen_ids"], ex["chosen_mask"], strict=True) if not m])
    assert GOOD[0] in agent and GOOD[2] in agent and "OBSERVATION" not in agent and "OBSERVATION" in other
    assert tokenizer.decode(ex["prompt_ids"]).endswith("Do it.<|end|>\n<|assistant|>\n")  # the header is context
    _, Collator = _trainer_classes()
    batch = Collator(pad_token_id=tokenizer.pad_token_id)([ex, ex])
    row = batch["input_ids"][0][batch["completion_mask"][0].bool()].tolist()
    assert "OBSERVATION" not in tokenizer.decode(row) and GOOD[2] in tokenizer.decode(row)
    assert batch["completion_mask"].shape == batch["input_ids"].shape
