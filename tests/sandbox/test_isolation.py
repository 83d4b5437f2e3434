"""Escape attempts from code actions: none escapes, each is stopped within its limit, the env goes on."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from components.core.schema import Task, Verifier
from components.sandbox.env import WorkspaceEnv
from components.sandbox.expert import render_code

MARK = f"/tmp/agentrl-escape-{uuid.uuid4().hex}"

ATTEMPTS = [
    f"import os\nos.system('touch {MARK}')",
    "from os import system",
    f"__import__('os').system('touch {MARK}')",
    "().__class__.__bases__[0].__subclasses__()",
    "[].__class__.__mro__",
    "getattr(apis, '__class__')",
    "'{0.__class__}'.format(apis)",
    "'{.__class__.__base__}'.format(1)",
    "print(open('/etc/passwd').read())",
    f"exec(\"import os; os.system('touch {MARK}')\")",
    "eval('1+1')",
    "compile('x', 'f', 'exec')",
    "print(globals())",
    "print(locals())",
    "print(vars())",
    "print(type(apis))",
    "object.__subclasses__()",
    "apis._app",
    "apis.mail._tool",
    "f = lambda: 0\nf.__globals__",
    "def g():\n    yield 1\nx = g()\nx.gi_frame.f_back.f_globals",
    "try:\n    1/0\nexcept Exception as e:\n    e.__traceback__.tb_frame.f_globals",
    "print.__self__",
    "while True:\n    pass",
    "x = 'a' * (10 ** 10)",
    "l = []\nwhile True:\n    l.append('x' * 10 ** 6)",
    "def r(n):\n    return r(n + 1)\nr(0)",
    "print('x' * 10 ** 9)",
    "for i in range(10 ** 9):\n    print(i)",
    "sum(range(10 ** 12))",
    "apis.__class__",
    "apis.mail.search.__call__.__closure__",
    "ApiError.__subclasses__()",
    "s = 'x'\ns.format_map({})",
    "help()",
    "breakpoint()",
    "input()",
    "super()",
    "class A:\n    pass",
    "global x\nx = 1",
    "async def f():\n    pass",
    "dir()",
    "[c for c in ().__class__.__base__.__subclasses__()]",
    "f = lambda __x: __x",
    "memoryview(b'x')",
    "bytearray(10 ** 10)",
    "apis.mail.search(query='x' * 10 ** 6)",
    "while True:\n    apis.mail.search()",
    "sys.modules['os'].system('id')",
    "print(f'{apis!r:>{10 ** 9}}')",
    "[].__reduce_ex__(2)",
    "x = [[]] * 10 ** 9",
    "import ctypes",
    "from . import worker_entry",
]

WORKS = "print(len(apis.mail.search(limit=3)['items']))"


@pytest.fixture(scope="module")
def coded(world, cfg):
    env = WorkspaceEnv(world, cfg, action_format="code")
    yield env
    env.close()


def test_at_least_forty_attempts():
    assert len(ATTEMPTS) >= 40


@pytest.mark.parametrize("code", ATTEMPTS, ids=[a.splitlines()[0][:40] for a in ATTEMPTS])
def test_escape_attempt_is_contained(coded, cfg, code):
    task = Task("t-iso", "s:alice", 1, "train", "isolation", "alice", Verifier("state", {}))
    coded.reset(task)
    t0 = time.monotonic()
    res = coded.step(render_code("Trying something.", code))
    elapsed = time.monotonic() - t0
    obs = json.loads(res.observation)
    assert not os.path.exists(MARK), "escaped: wrote a file"
    assert "root:" not in res.observation, "escaped: read /etc/passwd"
    assert "Workspace" not in res.observation and "World" not in res.observation
    # stopped by a limit or refused, never allowed to run away
    assert elapsed < cfg.code_wall_timeout_s + 5
    if obs["ok"]:
        assert len(obs.get("stdout", "")) <= cfg.code_output_chars
    # the environment is still usable afterwards
    res2 = coded.step(render_code("Now a normal action.", WORKS))
    out = json.loads(res2.observation)
    assert out["ok"] and out["stdout"].strip() == "3", out


def test_limits_report_what_stopped_the_code(coded):
    task = Task("t-iso", "s:alice", 1, "train", "isolation", "alice", Verifier("state", {}))
    cases = {
        "while True:\n    pass": ("WorkerError", "TimeoutError"),
        "x = 'a' * (10 ** 10)": ("MemoryError",),
        "def r(n):\n    return r(n + 1)\nr(0)": ("RecursionError",),
        "for i in range(10 ** 9):\n    print(i)": ("output limit",),
        "import os": ("imports are not allowed",),
    }
    for code, expected in cases.items():
        coded.reset(task)
        obs = json.loads(coded.step(render_code("x", code)).observation)
        text = json.dumps(obs)
        assert any(e in text for e in expected), (code, obs)


def test_worker_state_is_rebuilt_after_a_crash(world, cfg):
    env = WorkspaceEnv(world, cfg, action_format="code")
    try:
        env.reset(Task("t1", "s:alice", 1, "train", "x", "alice", Verifier("state", {})))
        env.step(render_code("Define a helper.", "def n_items(limit):\n    return len(apis.mail.search(limit=limit)['items'])"))
        env.step(render_code("Crash the worker.", "while True:\n    pass"))
        obs = json.loads(env.step(render_code("Use the helper.", "print(n_items(2))")).observation)
        assert obs["ok"] and obs["stdout"].strip() == "2"
    finally:
        env.close()
