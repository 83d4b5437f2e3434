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
_DECODER = json.JSONDecoder()


class FormatError(ValueError):
    pass


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
