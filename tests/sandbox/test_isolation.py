"""Escape attempts from code actions: none escapes, each is stopped within its limit, the env goes on."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from components.core.schema import Task, Verifier
from components.sandbox.expert import render_code
from components.sandbox.workspace import WorkspaceEnv

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
    # class patterns read attributes: the policy walks every identifier field of the grammar
    "match 1:\n    case int(__class__=c):\n        print(c.__subclasses__())",
    "match 'x':\n    case str(format=f):\n        print(f('{0.__class__}', 1))",
    "match apis:\n    case object(__class__=c):\n        print(c)",
    "match ApiError:\n    case type(mro=m):\n        print(m())",
    "match {}:\n    case {**__rest}:\n        print(__rest)",
    "match [1]:\n    case [*__s]:\n        print(__s)",
    "match 1:\n    case __z:\n        print(__z)",
    "print(__x=1)",
]

WORKS = "print(len(apis.mail.search(limit=3)['items']))"


@pytest.fixture(scope="module")
def coded(world, cfg):
    env = WorkspaceEnv(world, cfg, action_format="code")
    yield env
    env.close()


def test_at_least_sixty_attempts_in_all():
    assert len(ATTEMPTS) >= 60 and len(ATTEMPTS) + len(BYPASS) >= 100


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


# ---------------------------------------------------------------------------------------------------------------
# The policy bypassed: code sent straight to the worker, which runs it with the real builtins one gadget away.
# The OS walls alone must hold: no process, no file written, no network, no parent environment or secret.
# ---------------------------------------------------------------------------------------------------------------
GADGET = ("G = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]"
          ".__init__.__globals__\nI = G['__builtins__']['__import__']\nB = G['__builtins__']\n")
BYPASS = {
    "os.system": "print(G['system']('touch {mark}'))",
    "os.popen": "print(G['popen']('touch {mark}').read())",
    "fork": "print(G['fork']())",
    "execv": "G['execv']('/bin/sh', ['sh', '-c', 'touch {mark}'])",
    "posix_spawn": "print(G['posix_spawn']('/usr/bin/touch', ['touch', '{mark}'], {{}}))",
    "subprocess": "print(I('subprocess').run(['touch', '{mark}']))",
    "forkpty": "print(G['forkpty']())",
    "thread": "t = I('threading').Thread(target=print)\nt.start()",
    "os.open create": "print(G['open']('{mark}', G['O_WRONLY'] | G['O_CREAT']))",
    "builtin open write": "B['open']('{mark}', 'w').write('x')",
    "io.open append": "I('io').open('{mark}', 'a').write('x')",
    "write in the workdir": "B['open']('here.txt', 'w').write('x')\nprint(G['listdir']('.'))",
    "mkdir": "G['mkdir']('{mark}')",
    "symlink": "G['symlink']('/etc/passwd', '{mark}')",
    "hard link": "G['link']('{victim}', '{mark}')",
    "unlink a victim": "G['unlink']('{victim}')",
    "rename a victim": "G['rename']('{victim}', '{mark}')",
    "chmod a victim": "G['chmod']('{victim}', 0o777)",
    "truncate a victim": "G['truncate']('{victim}', 0)",
    "open a victim read-write": "fd = G['open']('{victim}', G['O_RDWR'])\nG['write'](fd, b'owned')",
    "copy a secret": "I('shutil').copy('{secret}', '{mark}')",
    "read a secret": "print(B['open']('{secret}').read())",
    "parent environment": "print(B['open']('/proc/%d/environ' % G['getppid']()).read())",
    "own environment": "print(dict(G['environ']))",
    "pid 1 environment": "print(B['open']('/proc/1/environ').read())",
    "tcp to the host": "s = I('socket').socket(2, 1)\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))",
    "udp to the host": "s = I('socket').socket(2, 2)\ns.sendto(b'hi', ('127.0.0.1', {port}))",
    "tcp6 to the host": "s = I('socket').socket(10, 1)\ns.settimeout(1)\ns.connect(('::1', {port}))",
    "unix socket": "s = I('socket').socket(1, 1)\ns.connect('/run/systemd/private')",
    "kill the parent": "G['kill'](G['getppid'](), 9)",
    "kill every process": "G['kill'](-1, 9)",
    "setuid root": "G['setuid'](0)\nprint(G['getuid']())",
    "raise the process limit": "r = I('resource')\nr.setrlimit(r.RLIMIT_NPROC, (100, 100))\nprint(G['fork']())",
    "ctypes unshare": "print(I('ctypes').CDLL(None).unshare(0x10000000))\nprint(G['fork']())",
    "ctypes ptrace the parent": "print(I('ctypes').CDLL(None).ptrace(16, G['getppid'](), 0, 0))",
    "ctypes mount": "print(I('ctypes').CDLL(None).mount(b'none', b'/mnt', b'tmpfs', 0, 0))",
    "memfd exec": "fd = G['memfd_create']('x')\nG['write'](fd, B['open']('/bin/sh', 'rb').read())",
    "pty": "print(G['openpty']())",
    "shm file": "B['open']('/dev/shm/{name}', 'w').write('x')",
    # a length header of 2 GB on the real channel: the parent reads at most MAX_MESSAGE_BYTES and moves on
    "forge a protocol message": "G['write'](int(G['sys'].argv[1]), b'\\x7f\\xff\\xff\\xf0garbage')",
    "spoof the reply": "G['write'](int(G['sys'].argv[1]), b'\\x00\\x00\\x00\\x15[\"done\",true,\"x\",\"\"]')\n"
                       "G['system']('touch {mark}')",
}


@pytest.fixture(scope="module")
def walls(tmp_path_factory):
    import socket

    root = tmp_path_factory.mktemp("escape")
    root.chmod(0o755)
    victim, secret = root / "victim.txt", root / "secret.txt"
    victim.write_text("intact")
    victim.chmod(0o644)
    secret.write_text(f"SECRET-{uuid.uuid4().hex}")
    secret.chmod(0o600)
    os.environ["AGENTRL_ESCAPE_SECRET"] = env_secret = f"ENV-{uuid.uuid4().hex}"
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    yield {"root": root, "victim": victim, "secret": secret, "env_secret": env_secret, "listener": listener,
           "port": listener.getsockname()[1]}
    listener.close()
    del os.environ["AGENTRL_ESCAPE_SECRET"]


def test_the_worker_runs_behind_every_os_wall():
    from components.sandbox.worker import CodeRunner, Limits

    runner = CodeRunner(Limits(isolation="strict"))
    try:
        runner.reset()
        assert runner.walls == dict.fromkeys(("network", "uid", "processes", "files", "file_size", "core", "seccomp"),
                                             True)
    finally:
        runner.close()


@pytest.mark.parametrize("name", list(BYPASS))
def test_with_the_policy_bypassed_the_os_walls_alone_hold(walls, name):
    from components.sandbox.worker import CodeRunner, Limits

    mark = walls["root"] / f"mark-{uuid.uuid4().hex}"
    code = GADGET + BYPASS[name].format(mark=mark, victim=walls["victim"], secret=walls["secret"], port=walls["port"],
                                        name=mark.name)
    runner = CodeRunner(Limits(cpu_time_s=2.0, wall_timeout_s=5.0, isolation="strict"))
    try:
        runner.reset()
        res = runner.run(code, lambda *a: (False, (400, "no API in this test")))
        text = res.stdout + res.error
        assert not mark.exists() and not (walls["root"] / mark.name).exists(), "escaped: a file was written"
        assert not os.path.exists(f"/dev/shm/{mark.name}")
        assert walls["victim"].read_text() == "intact" and oct(walls["victim"].stat().st_mode)[-3:] == "644"
        assert walls["secret"].read_text() not in text and walls["env_secret"] not in text, "escaped: a secret leaked"
        try:
            conn, _ = walls["listener"].accept()
            conn.close()
            raise AssertionError("escaped: reached the host's network")
        except TimeoutError:
            pass
        # the environment around it goes on: a fresh worker runs normal code
        runner.reset()
        assert runner.run("print(6 * 7)", lambda *a: (False, (400, ""))).stdout == "42\n"
    finally:
        runner.close()


def test_the_gadget_does_reach_the_real_os_module():
    """The bypass corpus is meaningful: without the policy the code does hold os.system and the real builtins."""
    from components.sandbox.worker import CodeRunner, Limits

    runner = CodeRunner(Limits(isolation="strict"))
    try:
        runner.reset()
        res = runner.run(GADGET + "print(G['system'].__name__, B['open'].__name__, G['getuid']())",
                         lambda *a: (False, (400, "")))
        assert res.stdout.split() == ["system", "open", "65534"], res
    finally:
        runner.close()


def test_python_state_does_not_outlive_its_episode(world, cfg):
    env = WorkspaceEnv(world, cfg, action_format="code")
    try:
        for i, user in enumerate(("alice", "bob")):
            env.reset(Task(f"t{i}", f"s:{user}", 1, "train", "x", user, Verifier("state", {})))
            if i == 0:  # the class is shared by everything in the worker; the policy allows setting a plain attribute
                obs = json.loads(env.step(render_code("Stash.", "ApiError.stash = apis.mail.search(limit=1)\nprint('ok')"
                                                     )).observation)
                assert obs["ok"], obs
            else:
                obs = json.loads(env.step(render_code("Read.", "print(ApiError.stash)")).observation)
                assert not obs["ok"] and "AttributeError" in json.dumps(obs), obs
    finally:
        env.close()
