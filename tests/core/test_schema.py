from __future__ import annotations

import json

import pytest

from components.core import storage
from components.core.schema import (
    ABRecord,
    Feedback,
    ModelCard,
    PreferencePair,
    RewardBreakdown,
    SchemaError,
    Subgoal,
    Task,
    Trajectory,
    Turn,
    Verdict,
    Verifier,
    from_record,
    read_jsonl,
    to_record,
    write_jsonl,
)


def task(i: int = 0) -> Task:
    return Task(
        id=f"t{i}", scenario_id="s0", level=2, suite="easy", instruction="Move the budget mails",
        user_id="u0", verifier=Verifier("folder_contains", {"folder": "Finance", "ids": ["m1"]}),
        subgoals=[Subgoal("find", "find the mails", Verifier("retrieved", {"ids": ["m1"]}))], tags=["mail"],
    )


def trajectory(i: int = 0) -> Trajectory:
    return Trajectory(
        task_id=f"t{i}", policy="sft-1",
        turns=[
            Turn("user", "Move the budget mails"),
            Turn("assistant", '{"tool": "mail.search"}', action={"tool": "mail.search", "args": {}},
                 tokens=[5, 6, 7], mask=[1, 1, 1], logprobs=[-0.1, -0.2, -0.3], step_reward=0.05),
            Turn("tool", '{"status": 200}', observation='{"status": 200}'),
        ],
        verdict=Verdict(True, ["find"], []), reward=RewardBreakdown(1.25, {"task": 1.0, "subgoal": 0.2, "api": 0.05}),
        steps=1, generated_tokens=3, skills_used=["move_all"], chain_id="c0", chain_position=0,
    )


def test_every_record_roundtrips(tmp_path):
    recs = {
        Task: task(),
        Trajectory: trajectory(),
        ABRecord: ABRecord("r1", "t0", "A", "champion-3", trajectory(), Feedback("up", None), task=task()),
        PreferencePair: PreferencePair([{"role": "user", "content": "x"}], [{"role": "assistant", "content": "a"}],
                                       [{"role": "assistant", "content": "b"}], "ab", "t0"),
        ModelCard: ModelCard("tiny", "sft", metrics={"easy/tgc": 0.5}),
    }
    for cls, rec in recs.items():
        path = tmp_path / f"{cls.__name__}.jsonl"
        assert write_jsonl(path, [rec, rec]) == 2
        first = json.loads(path.read_text().splitlines()[0])
        assert first["schema"] == f"agentrl/{cls.KIND}/v1"
        assert list(read_jsonl(path, cls)) == [rec, rec]


def test_s3_roundtrip_many_files(bucket):
    prefix = f"s3://{bucket}/logs"
    write_jsonl(f"{prefix}/day1.jsonl", [task(i) for i in range(3)])
    write_jsonl(f"{prefix}/day2.jsonl", [task(i) for i in range(3, 5)])
    storage.write_text(f"{prefix}/README.txt", "not a jsonl file")
    got = list(read_jsonl(prefix, Task))
    assert [t.id for t in got] == ["t0", "t1", "t2", "t3", "t4"]
    assert [t.id for t in read_jsonl(f"{prefix}/day2.jsonl", Task)] == ["t3", "t4"]


def _lines(*recs) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in recs) + "\n"


@pytest.mark.parametrize(
    "bad,reason",
    [
        ('{"schema": "agentrl/task/v1", "id": ', "not valid JSON"),
        ({**to_record(task()), "schema": "agentrl/task/v2"}, "unknown schema version 'agentrl/task/v2'"),
        ({**to_record(task()), "schema": "agentrl/trajectory/v1"}, "expected schema 'agentrl/task/v1'"),
        ({k: v for k, v in to_record(task()).items() if k != "id"}, "id: Field required"),
        ({**to_record(task()), "instruction": ""}, "`id` and `instruction` must not be empty"),
        ({**to_record(task()), "level": 9}, "level must be 1..5"),
        ({**to_record(task()), "suite": "held out!"}, "suite 'held out!'"),
        ({**to_record(task()), "surprise": 1}, "surprise"),
        ("[1, 2, 3]", "expected a JSON object"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "tasks.jsonl"
    path.write_text(_lines(to_record(task(0)), to_record(task(1)), bad, to_record(task(3))))
    with pytest.raises(SchemaError) as err:
        list(read_jsonl(path, Task))
    assert str(err.value).startswith(f"{path}:3: ")
    assert reason in str(err.value)


def test_skip_invalid_counts_and_reports(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(_lines(to_record(task(0)), "garbage", to_record(task(2)), {**to_record(task()), "level": 0}))
    reader = read_jsonl(path, Task, skip_invalid=True)
    assert [t.id for t in reader] == ["t0", "t2"]
    assert reader.report.read == 2 and reader.report.skipped == 2
    assert reader.report.errors[0].startswith(f"{path}:2:") and reader.report.errors[1].startswith(f"{path}:4:")


def test_blank_lines_are_ignored_and_missing_files_are_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n" + _lines(to_record(task())) + "\n\n")
    assert len(list(read_jsonl(path, Task))) == 1
    with pytest.raises(FileNotFoundError):
        list(read_jsonl(tmp_path / "nope.jsonl", Task))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .jsonl files"):
        list(read_jsonl(tmp_path / "empty", Task))


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "t.jsonl"
    write_jsonl(path, [task(0)])

    def gen():
        yield task(1)
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        write_jsonl(path, gen())
    assert [t.id for t in read_jsonl(path, Task)] == ["t0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_reader_streams(tmp_path):
    path = tmp_path / "big.jsonl"
    write_jsonl(path, (task(i) for i in range(2000)))
    it = iter(read_jsonl(path, Task))
    assert next(it).id == "t0"  # first record available before the rest is parsed


def test_from_record_rejects_non_records():
    with pytest.raises(TypeError):
        to_record({"a": 1})
    with pytest.raises(ValueError, match="expected schema"):
        from_record(Task, {"id": "x"})
