"""The data contracts between phases (DESIGN.md §3): dataclasses + streaming, versioned JSON lines.

Every record on disk carries `"schema": "agentrl/<kind>/v1"`. Readers stream (one line in memory at a
time), validate each record against its dataclass (pydantic does the type checking) and fail on the
first bad line with `file:line` and the reason — or, with `skip_invalid=True`, count and report the
skipped lines instead. Writers write to a temporary file and move it into place (or upload it), so a
crash never leaves a half-written file that a reader would take for a whole one.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from components.core import storage

__all__ = [
    "ABRecord",
    "Feedback",
    "ModelCard",
    "PreferencePair",
    "ReadReport",
    "RewardBreakdown",
    "SchemaError",
    "Subgoal",
    "Task",
    "Trajectory",
    "Turn",
    "Verdict",
    "Verifier",
    "JsonlReader",
    "read_jsonl",
    "write_jsonl",
    "to_record",
    "from_record",
]

Role = Literal["system", "user", "assistant", "tool"]
_STRICT = ConfigDict(extra="forbid")


class SchemaError(ValueError):
    """A record that does not match its contract; the message starts with `file:line`."""


# ------------------------------------------------------------------------------------------
# Records
# ------------------------------------------------------------------------------------------
@dataclass
class Verifier:
    __pydantic_config__ = _STRICT
    kind: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Subgoal:
    __pydantic_config__ = _STRICT
    id: str
    description: str
    verifier: Verifier


@dataclass
class Task:
    """One task of an environment. The workspace fills every field; another environment needs only `id` and
    `instruction` (and its suite): `scenario_id` defaults to the id, `level` to 1, and what only that environment
    reads (its initial state, arguments, expected end state) goes in `payload`."""

    __pydantic_config__ = _STRICT
    KIND: ClassVar[str] = "task"
    id: str
    scenario_id: str = ""
    level: int = 1
    suite: str = "train"  # the workspace's: train/easy/hard/safety/robustness/practice; any name elsewhere
    instruction: str = ""
    user_id: str = ""  # the workspace's acting user
    verifier: Verifier | None = None  # the workspace's verifier; another environment checks its own way
    subgoals: list[Subgoal] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    # environment options never shown to the agent (faults, the simulated user's answers, setup)
    options: dict[str, Any] = field(default_factory=dict)
    # a reference solution for expert demonstrations and repair (never shown to the agent)
    solution: dict[str, Any] = field(default_factory=dict)
    # what only the task's environment reads (never shown to the agent)
    payload: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id or not self.instruction:
            raise ValueError(f"task {self.id!r}: `id` and `instruction` must not be empty")
        if not 1 <= int(self.level) <= 5:
            raise ValueError(f"level must be 1..5, got {self.level}")
        if not self.suite.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"suite {self.suite!r}: expected a name of letters, digits, '_' or '-'")
        self.scenario_id = self.scenario_id or self.id


@dataclass
class Turn:
    """One message. For agent turns `tokens` are the ids that were sampled (token-in/token-out),
    `logprobs` their sampling log-probabilities; `mask` marks the tokens trained on."""

    __pydantic_config__ = _STRICT
    role: Role
    text: str
    action: dict[str, Any] | None = None
    observation: str | None = None
    step_reward: float = 0.0
    tokens: list[int] | None = None
    mask: list[int] | None = None
    logprobs: list[float] | None = None
    credit: float | None = None  # per-turn credit (agent turns), from rewards.turn_credit
    info: dict[str, Any] = field(default_factory=dict)  # the environment's step info (tool turns)


@dataclass
class Verdict:
    __pydantic_config__ = _STRICT
    success: bool
    subgoals_done: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


@dataclass
class RewardBreakdown:
    """`total` is what the optimiser sees; `components` holds one entry per reward component."""

    __pydantic_config__ = _STRICT
    total: float
    components: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    __pydantic_config__ = _STRICT
    KIND: ClassVar[str] = "trajectory"
    task_id: str
    policy: str
    turns: list[Turn]
    verdict: Verdict
    reward: RewardBreakdown
    steps: int = 0
    generated_tokens: int = 0
    skills_defined: list[str] = field(default_factory=list)
    skills_used: list[str] = field(default_factory=list)
    chain_id: str | None = None
    chain_position: int | None = None
    truncated: bool = False
    finish_reason: str = "done"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Feedback:
    """The user's word on one served answer.

    `thumb`: up or down (or none). `correction`: the agent reply the user wanted instead of the one at
    turn `correction_turn` (an index into the trajectory's turns, an assistant turn; None = the first
    assistant turn) — e.g. the right tool call; a pair (correction over the original) is built from it.
    """

    __pydantic_config__ = _STRICT
    thumb: Literal["up", "down"] | None = None
    correction: str | None = None
    correction_turn: int | None = None


@dataclass
class ABRecord:
    """One served answer of an A/B deployment: a request, the variant that answered, and the feedback."""

    __pydantic_config__ = _STRICT
    KIND: ClassVar[str] = "ab"
    request_id: str
    task_id: str
    variant: Literal["A", "B"]
    model_id: str
    trajectory: Trajectory
    feedback: Feedback = field(default_factory=Feedback)
    timestamp: float = field(default_factory=time.time)
    task: Task | None = None


@dataclass
class PreferencePair:
    __pydantic_config__ = _STRICT
    KIND: ClassVar[str] = "pair"
    prompt: list[dict[str, Any]]  # chat messages; the system one may carry the environment's `tools`
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    source: Literal["ab", "rollout", "step"]
    task_id: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelCard:
    """`agentrl.json` beside a model directory: where it came from and how it scored."""

    __pydantic_config__ = _STRICT
    KIND: ClassVar[str] = "model"
    base_model: str
    phase: str
    kind: Literal["full", "lora"] = "full"
    parent_run_id: str | None = None
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)


RECORD_TYPES: dict[str, type] = {t.KIND: t for t in (Task, Trajectory, ABRecord, PreferencePair, ModelCard)}
VERSION = "v1"
T = TypeVar("T")


def schema_id(cls: type) -> str:
    return f"agentrl/{cls.KIND}/{VERSION}"


def to_record(obj: Any) -> dict[str, Any]:
    if not is_dataclass(obj) or not hasattr(type(obj), "KIND"):
        raise TypeError(f"{type(obj).__name__} is not an agentrl record")
    return {"schema": schema_id(type(obj)), **asdict(obj)}


_ADAPTERS: dict[type, TypeAdapter] = {}


def _adapter(cls: type) -> TypeAdapter:
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def _explain(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:3]:
        loc = ".".join(str(p) for p in e["loc"]) or "<record>"
        parts.append(f"{loc}: {e['msg']}")
    more = len(err.errors()) - 3
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def from_record(cls: type[T], data: dict[str, Any]) -> T:
    """Validate a dict (with its `schema` key) into `cls`; raises ValueError with the reason."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    sid = data.get("schema")
    want = schema_id(cls)
    if sid != want:
        if isinstance(sid, str) and sid.startswith(f"agentrl/{cls.KIND}/"):
            raise ValueError(f"unknown schema version {sid!r} (this agentrl reads {want!r})")
        raise ValueError(f"expected schema {want!r}, got {sid!r}")
    body = {k: v for k, v in data.items() if k != "schema"}
    try:
        return _adapter(cls).validate_python(body)
    except ValidationError as err:
        raise ValueError(_explain(err)) from None


# ------------------------------------------------------------------------------------------
# JSONL
# ------------------------------------------------------------------------------------------
@dataclass
class ReadReport:
    read: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # the first few skipped lines, file:line: reason


class JsonlReader(Generic[T]):
    """Iterate the records of one or many JSONL files (a file, a directory or an s3:// prefix).

    Strict by default: the first invalid line raises SchemaError('file:line: reason'). With
    `skip_invalid=True` invalid lines are skipped and counted in `.report`.
    """

    def __init__(self, uri: str | os.PathLike, cls: type[T], skip_invalid: bool = False) -> None:
        self.uri = str(uri)
        self.cls = cls
        self.skip_invalid = skip_invalid
        self.report = ReadReport()

    def files(self) -> list[str]:
        uri = self.uri
        if storage.is_s3(uri):
            bucket, key = storage.split_s3(uri)
            if key and not key.endswith("/") and storage.exists(uri):
                try:
                    storage.s3_client().head_object(Bucket=bucket, Key=key)
                    return [uri]
                except Exception:
                    pass
            found = [u for u in storage.list_uris(uri) if u.endswith((".jsonl", ".jsonl.txt"))]
        else:
            p = Path(uri)
            if p.is_file():
                return [uri]
            if not p.exists():
                raise FileNotFoundError(f"{uri}: no such file or directory")
            found = [u for u in storage.list_uris(uri) if u.endswith(".jsonl")]
        if not found:
            raise FileNotFoundError(f"{uri}: no .jsonl files")
        return found

    def __iter__(self) -> Iterator[T]:
        for f in self.files():
            for lineno, raw in enumerate(storage.open_byte_lines(f), start=1):
                if not raw.strip():
                    continue
                try:
                    data = json.loads(raw.decode("utf-8"))
                    json.dumps(data, ensure_ascii=False).encode("utf-8")  # lone surrogates ("\ud800") are no text
                    rec = from_record(self.cls, data)
                except (ValueError, TypeError, RecursionError) as exc:
                    where = f"{f}:{lineno}: {_reason(exc)}"
                    if not self.skip_invalid:
                        raise SchemaError(where) from None
                    self.report.skipped += 1
                    if len(self.report.errors) < 20:
                        self.report.errors.append(where)
                    continue
                self.report.read += 1
                yield rec


def _reason(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON ({exc.msg})"
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte {exc.start})"
    if isinstance(exc, UnicodeEncodeError):
        return "text with a lone surrogate (not encodable as UTF-8)"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc)[:500]


def read_jsonl(uri: str | os.PathLike, cls: type[T], skip_invalid: bool = False) -> JsonlReader[T]:
    return JsonlReader(uri, cls, skip_invalid=skip_invalid)


def write_jsonl(uri: str | os.PathLike, records: Iterable[Any]) -> int:
    """Stream records to `uri` (local path or s3://); the file appears only when complete. Returns the count."""
    uri = str(uri)
    n = 0
    local_dir = None if storage.is_s3(uri) else Path(uri).parent
    if local_dir is not None:
        local_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".records.", suffix=".jsonl", dir=local_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(to_record(rec), ensure_ascii=False, separators=(",", ":")) + "\n")
                n += 1
            fh.flush()
            os.fsync(fh.fileno())
        if storage.is_s3(uri):
            storage.put_file(tmp, uri)
            os.unlink(tmp)
        else:
            os.replace(tmp, uri)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


def field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]
