"""10,000 random or malformed actions: nothing escapes `step` as an exception, and the env still works."""

from __future__ import annotations

import json
import random

from components.core.env import StepResult
from components.sandbox import expert
from components.sandbox.apis import CATALOGUE
from components.sandbox.workspace import WorkspaceEnv
from tests.sandbox.conftest import first

TOOLS = [t.name for t in CATALOGUE]


def garbage(rng: random.Random) -> str:
    kind = rng.randrange(19)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200))).decode("latin-1")
    if kind == 1:  # broken JSON
        good = json.dumps({"tool": rng.choice(TOOLS), "args": {"ids": ["m1"], "folder": "HR"}})
        return good[: rng.randrange(len(good))]
    if kind == 2:
        return json.dumps({"tool": "".join(rng.choice("abc._") for _ in range(8)), "args": {}})
    if kind == 3:  # wrong types
        val = rng.choice([1, -1, 1.5, True, None, [], {}, [1, 2], {"a": 1}, "x"])
        tool = rng.choice(TOOLS)
        spec = next(t for t in CATALOGUE if t.name == tool)
        args = {p.name: val for p in spec.params}
        return json.dumps({"tool": tool, "args": args})
    if kind == 4:  # huge arguments
        return json.dumps({"tool": "mail.search", "args": {"query": "x" * rng.choice([3000, 100_000])}})
    if kind == 5:
        return json.dumps({"tool": "mail.move", "args": {"ids": [f"m{i}" for i in range(rng.choice([101, 5000]))],
                                                         "folder": "HR"}})
    if kind == 6:  # deep nesting
        depth = rng.choice([50, 5000, 100_000])
        return '{"tool": "mail.read", "args": ' + "[" * depth + "]" * depth + "}"
    if kind == 7:
        return json.dumps({"tool": "mail.read", "args": [1, 2]})
    if kind == 8:
        return json.dumps({"tool": None, "args": {}, "extra": 1})
    if kind == 9:  # code with syntax errors
        return "```python\n" + "".join(rng.choice("()[]{}:=+ abc\n") for _ in range(60)) + "\n```"
    if kind == 10:  # code that reaches the worker and fails there
        return "```python\n" + rng.choice(["1/0", "apis.mail.nope()", "apis.mail.read(id=5)", "x = undefined",
                                          "apis.mail.search(1, 2, 3, 4, 5, 6, 7)", "[][1]"]) + "\n```"
    if kind == 11:
        return "```python\nprint('unclosed"
    if kind == 12:
        return "\x00" * rng.randrange(1, 50) + "{}"
    if kind == 14:  # integers past Python's 4,300-digit conversion limit, anywhere in the action
        big = "9" * rng.choice([4301, 6000, 50_000])
        tool = rng.choice(TOOLS)
        return rng.choice([f'{{"tool": "{tool}", "args": {{"limit": {big}}}}}', f'{{"tool": {big}, "args": {{}}}}',
                           f'{{"tool": "mail.read", "args": {{"id": [{big}]}}}}'])
    if kind == 15:  # lone surrogates, escaped in the JSON and raw in the text
        s = rng.choice(["\\ud800", "\\udfff", "x\\udc80y"])
        return rng.choice([f'{{"tool": "mail.search", "args": {{"query": "{s}"}}}}',
                           f'{{"tool": "{s}", "args": {{}}}}', f'{{"tool": "mail.read", "args": {{"{s}": 1}}}}',
                           "Thought: \ud800 " + json.dumps({"tool": "mail.search", "args": {"query": "a"}})])
    if kind == 16:  # numbers JSON allows and Python reads as inf/nan, or as huge floats
        tool = rng.choice(TOOLS)
        spec = next(t for t in CATALOGUE if t.name == tool)
        val = rng.choice(["NaN", "Infinity", "-Infinity", "1e308", "-1e400", "1e-400"])
        args = ", ".join(f'"{p.name}": {val}' for p in spec.params)
        return '{"tool": "' + tool + '", "args": {' + args + "}}"
    if kind == 17:  # a valid tool with random extra or renamed arguments
        tool = rng.choice(TOOLS)
        return json.dumps({"tool": tool, "args": {rng.choice(["", "__class__", "ids", "x" * 300]): ["a"] * 3}})
    return "Thought: " + "word " * rng.randrange(3000)


def test_ten_thousand_malformed_actions(world, cfg, suites):
    rng = random.Random(1234)
    env = WorkspaceEnv(world, cfg)
    tasks = suites["easy"]
    exceptions, steps, resets = [], 0, 0
    try:
        env.reset(tasks[0])
        while steps < 10_000:
            try:
                res = env.step(garbage(rng))
                assert isinstance(res, StepResult) and isinstance(res.observation, str)
                assert len(res.observation) <= cfg.observation_chars
                res.observation.encode("utf-8")  # no lone surrogate reaches the model or the wire
            except Exception as exc:  # noqa: BLE001 - counting is the test
                exceptions.append(repr(exc)[:200])
                res = None
            steps += 1
            if res is None or res.done:
                resets += 1
                env.reset(tasks[resets % len(tasks)])
        assert exceptions == [], f"{len(exceptions)} of 10,000 steps raised, e.g. {sorted(set(exceptions))[:5]}"
        assert resets > 500
        # still works: the expert solves tasks in both forms afterwards
        for form in ("json", "code"):
            env.action_format = form
            for t in (first(suites, "move_by_sender", "easy"), first(suites, "create_event", "easy")):
                _, verdict = (expert.solve_json if form == "json" else expert.solve_code)(env, t)
                assert verdict.success
    finally:
        env.close()
