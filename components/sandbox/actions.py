"""Parsing the agent's turn: an optional thought, then one action — a JSON tool call or a Python block.

    Thought: I need the ids first.
    {"tool": "mail.search", "args": {"sender": "alice"}}

    Thought: a reusable function.
    ```python
    def move_from(sender, topic, folder): ...
    move_from("alice", "budget", "Finance")
    ```
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_TURN_CHARS = 20_000
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


class FormatError(ValueError):
    pass


def _finite(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise FormatError(f"invalid JSON: the number {text[:20]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise FormatError(f"invalid JSON: {name} is not a JSON number")


# strict JSON numbers: no NaN/Infinity, no float that overflows to inf (1e400)
_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant)


_SURROGATE = re.compile("[\ud800-\udfff]")


def text_only(text: str) -> str:
    """`text` with every lone surrogate ('\\ud800', which no UTF-8 encoder accepts) replaced by U+FFFD."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def _clean(obj: Any) -> Any:
    """A parsed action with lone surrogates replaced in every key and string."""
    if isinstance(obj, str):
        return text_only(obj)
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    if isinstance(obj, dict):
        return {text_only(k): _clean(v) for k, v in obj.items()}
    return obj


@dataclass
class Action:
    kind: str  # "json" | "code"
    thought: str
    tool: str = ""
    args: dict[str, Any] | None = None
    code: str = ""

    def key(self) -> str:
        """Identity for repeat detection."""
        if self.kind == "code":
            return "code:" + self.code.strip()
        return "json:" + self.tool + ":" + json.dumps(self.args, sort_keys=True, default=str)


def _thought(prefix: str) -> str:
    t = prefix.strip()
    if t.lower().startswith("thought:"):
        t = t[len("thought:"):].strip()
    return t


def parse(text: str) -> Action:
    if not isinstance(text, str):
        raise FormatError("the reply must be text")
    if len(text) > MAX_TURN_CHARS:
        raise FormatError(f"the reply is longer than {MAX_TURN_CHARS} characters")
    text = text_only(text)
    fence = _FENCE.search(text)
    brace = text.find("{")
    if fence and (brace < 0 or fence.start() < brace):
        return Action("code", _thought(text[: fence.start()]), code=fence.group(1))
    if brace < 0:
        if "```" in text:
            raise FormatError("unclosed ``` code block")
        raise FormatError('no action: reply with {"tool": ..., "args": {...}} or a ```python block')
    try:
        obj, _ = _DECODER.raw_decode(text, brace)
    except json.JSONDecodeError as exc:
        raise FormatError(f"invalid JSON: {exc.msg} at char {exc.pos}") from None
    except RecursionError:
        raise FormatError("invalid JSON: nested too deeply") from None
    except FormatError:
        raise
    except ValueError:  # an integer past Python's 4,300-digit conversion limit
        raise FormatError("invalid JSON: a number with too many digits") from None
    obj = _clean(obj)
    if not isinstance(obj, dict):
        raise FormatError("the action must be a JSON object")
    extra = set(obj) - {"tool", "args"}
    if extra:
        raise FormatError(f"unexpected keys {sorted(map(str, extra))[:3]}; expected 'tool' and 'args'")
    tool = obj.get("tool")
    if not isinstance(tool, str) or not tool:
        raise FormatError("'tool' must be a non-empty string")
    args = obj.get("args", {})
    if not isinstance(args, dict):
        raise FormatError("'args' must be an object")
    return Action("json", _thought(text[:brace]), tool=tool, args=args)
