"""An environment over HTTP (the Kubernetes sandbox Deployment), and a client with the Environment protocol.

The workspace by default; any registered environment with `agentrl env serve --env NAME` (`create_app(environment=
...)`). Same contract as in process: a session is one environment (its own episode state, code or tool worker and,
in the workspace, skill library); many sessions are served concurrently. FastAPI + uvicorn do the
serving; what keeps tenants apart is written here (no library does per-session capabilities):

- a bearer token on every call but /healthz (`Authorization: Bearer <token>`); the server's tokens come
  from AGENTRL_SANDBOX_TOKENS or --token-file (lines `client:token` or bare tokens; the chart mounts a
  Secret). Without tokens it serves loopback only.
- `POST /sessions` returns a session id and a capability token; every later call on that session must
  present it (`X-Session-Token`): another client, even with a valid bearer token, gets 403.
- per-client quotas (sessions, requests in flight: 429), request bodies capped (413), actions cut to
  `max_action_chars`, task options checked against server caps (422), a bounded executor (503 when its
  queue is full), and /healthz answered on the event loop, never behind work.

    POST   /sessions                     {"action_format": "json"|"code"}  -> {"session": id, "token": capability}
    POST   /sessions/{id}/reset          {"task": <Task record>}          -> {"observation", "system_prompt", "tools"}
    POST   /sessions/{id}/step           {"action": text}                 -> StepResult
    POST   /sessions/{id}/verify                                          -> {"verdict", "episode"}
    GET    /sessions/{id}/skills                                          -> the session's skill library (workspace)
    DELETE /sessions/{id}                                                 -> 404 when unknown
    GET    /healthz (no auth), GET /tools
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the endpoints' string annotations from here

from components.core.config import RewardConfig, SandboxConfig, SandboxServerConfig
from components.core.env import StepResult
from components.core.schema import Task, Verdict, from_record, to_record
from components.sandbox.apis import CATALOGUE
from components.sandbox.skills import SkillLibrary
from components.sandbox.tasks import check_options
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import World, generate_world

TOKENS_ENV = "AGENTRL_SANDBOX_TOKENS"  # the server's: `client:token` per line (or comma), or bare tokens
CLIENT_TOKEN_ENV = "AGENTRL_SANDBOX_TOKEN"  # a client's own bearer token
SESSION_HEADER = "X-Session-Token"


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """token -> client name, from `client:token` entries (or bare tokens, named client1, client2, ...)."""
    out: dict[str, str] = {}
    for i, entry in enumerate(e.strip() for e in text.replace(",", "\n").splitlines()):
        if not entry or entry.startswith("#"):
            continue
        name, sep, token = entry.rpartition(":")
        name = name.strip() if sep else f"client{i + 1}"
        token = token.strip()
        if len(token) < 16:
            raise ValueError(f"{source}: token of client {name!r} is shorter than 16 characters")
        if token in out:
            raise ValueError(f"{source}: a token is listed twice (clients {out[token]!r} and {name!r})")
        out[token] = name
    return out


def load_tokens(token_file: str | None = None) -> dict[str, str]:
    tokens = {}
    if os.environ.get(TOKENS_ENV):
        tokens.update(parse_tokens(os.environ[TOKENS_ENV], TOKENS_ENV))
    if token_file:
        tokens.update(parse_tokens(Path(token_file).read_text(encoding="utf-8"), token_file))
    return tokens


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Session:
    env: Any  # a WorkspaceEnv, or another environment's episode
    token: str
    client: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    seen: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(self, make_env: Any, limits: SandboxServerConfig) -> None:
        self.make_env, self.limits = make_env, limits  # make_env(action_format) -> a fresh environment
        self.sessions: dict[str, Session] = {}
        self.reserved: dict[str, str] = {}  # session id -> client, while its environment is being built
        self.lock = threading.Lock()

    def create(self, action_format: str | None, client: str) -> tuple[str, str]:
        self.expire()
        with self.lock:
            if len(self.sessions) + len(self.reserved) >= self.limits.max_sessions:
                raise OverflowError(f"too many sessions on this server (limit {self.limits.max_sessions})")
            mine = sum(1 for s in self.sessions.values() if s.client == client) + sum(
                1 for c in self.reserved.values() if c == client)
            if mine >= self.limits.sessions_per_client:
                raise OverflowError(f"client {client!r} holds {mine} sessions (limit "
                                    f"{self.limits.sessions_per_client}); delete some first")
            sid, token = uuid.uuid4().hex, secrets.token_urlsafe(32)
            self.reserved[sid] = client  # the slot is taken while the (slower) environment is built, unlocked
        try:
            env = self.make_env(action_format)
            with self.lock:
                self.sessions[sid] = Session(env, token, client)
        finally:
            with self.lock:
                self.reserved.pop(sid, None)
        return sid, token

    def get(self, sid: str, token: str | None) -> Session:
        with self.lock:
            s = self.sessions.get(sid)
        if s is None:
            raise KeyError(sid)
        if not token or not hmac.compare_digest(token.encode(), s.token.encode()):
            raise PermissionError(sid)
        s.seen = time.monotonic()
        return s

    def delete(self, sid: str) -> bool:
        with self.lock:
            item = self.sessions.get(sid)
            if item is None:
                return False
            del self.sessions[sid]
        item.env.close()
        return True

    def expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            stale = [sid for sid, s in self.sessions.items() if now - s.seen > self.limits.idle_s]
        for sid in stale:
            self.delete(sid)

    def count(self) -> int:
        return len(self.sessions)

    def close(self) -> None:
        for sid in list(self.sessions):
            self.delete(sid)


class Executor:
    """A bounded pool for the blocking work (reset, step, verify): `workers` threads, `queue` waiting
    requests, `inflight_per_client` per client. Beyond it the request is answered at once (503 / 429),
    so a flood neither grows memory nor delays /healthz (served on the event loop)."""

    def __init__(self, limits: SandboxServerConfig) -> None:
        self.limits = limits
        self.limiter = self.threads = None  # made on first use, inside the event loop
        self.pending = 0
        self.running = 0
        self.per_client: dict[str, int] = {}

    async def run(self, client: str, fn, *args):
        import anyio
        from anyio import to_thread
        from fastapi import HTTPException

        if self.limiter is None:
            self.limiter = anyio.CapacityLimiter(self.limits.workers)
            self.threads = anyio.CapacityLimiter(self.limits.workers)  # anyio's own, sized to what we admit

        # the event loop is single-threaded: these counters need no lock
        if self.pending >= self.limits.workers + self.limits.queue:
            raise HTTPException(503, "sandbox busy: executor queue full, retry", headers={"Retry-After": "1"})
        if self.per_client.get(client, 0) >= self.limits.inflight_per_client:
            raise HTTPException(429, f"client {client!r} has {self.limits.inflight_per_client} requests in flight "
                                "(the per-client limit)", headers={"Retry-After": "1"})
        self.pending += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1
        try:
            async with self.limiter:
                self.running += 1
                try:
                    return await to_thread.run_sync(fn, *args, limiter=self.threads)
                finally:
                    self.running -= 1
        finally:
            self.pending -= 1
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]


def create_app(world: World | None = None, cfg: SandboxConfig | None = None, rewards: RewardConfig | None = None,
               tokens: dict[str, str] | None = None, environment: Any = None):
    """The ASGI app. `tokens`: bearer token -> client name; empty/None serves without authentication
    (`serve` allows that on loopback only). `environment`: another loaded environment (`core.env.load`) to serve
    instead of the workspace (its `factory()` makes the sessions' episodes; /healthz reports its `describe()`
    digest)."""
    from fastapi import Body, FastAPI, HTTPException
    from fastapi.responses import JSONResponse

    cfg = cfg or SandboxConfig()
    limits = cfg.server
    tokens = dict(tokens or {})
    if environment is None:
        world = world if world is not None else generate_world(cfg)
        rewards = rewards or RewardConfig()
        store = SessionStore(lambda fmt: WorkspaceEnv(world, cfg, rewards, SkillLibrary(max_size=limits.max_skills),
                                                      fmt), limits)
        world_digest = world.digest()[:16]  # the base world never changes (episodes work on copies)
        catalogue = [{"name": t.name, "description": t.description, "params": [asdict(p) for p in t.params]}
                     for t in CATALOGUE]
    else:
        store = SessionStore(lambda fmt: environment.factory(fmt)(), limits)
        described = environment.describe() if hasattr(environment, "describe") else {}
        world_digest = str(described.get("digest", ""))[:16]
        probe = environment.factory()()
        catalogue = list(getattr(probe, "tools", None) or [])
        probe.close()
    pool = Executor(limits)
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        yield
        store.close()  # stop every session's code worker

    class EscapedJSON(JSONResponse):
        """ASCII JSON: a lone surrogate that reached a reply (from a client's own task text) is written as an
        escape, not a UnicodeEncodeError and a 500."""

        def render(self, content: Any) -> bytes:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")

    app = FastAPI(title="agentrl sandbox", version="2", lifespan=lifespan, default_response_class=EscapedJSON)
    app.state.store, app.state.pool = store, pool

    @app.exception_handler(ValueError)
    async def bad_input(_request: Request, exc: ValueError):  # a body FastAPI could not read (e.g. a 5,000-digit int)
        return EscapedJSON({"detail": f"bad request: {str(exc)[:300]}"}, status_code=422)

    @app.exception_handler(RecursionError)
    async def too_deep(_request: Request, _exc: RecursionError):
        return EscapedJSON({"detail": "bad request: nested too deeply"}, status_code=422)

    @app.middleware("http")
    async def body_limit(request: Request, call_next):
        """413 for a body over max_request_bytes (by Content-Length, or counted while it streams). The rest of an
        over-long body is read and dropped, up to 16x the limit, so the client reads the 413 rather than a reset
        connection; past that the connection is closed."""
        declared = request.headers.get("content-length")
        too_big = EscapedJSON({"detail": f"request body over {limits.max_request_bytes} bytes"}, status_code=413)
        if declared is not None and declared.isdigit() and int(declared) <= limits.max_request_bytes:
            return await call_next(request)
        if request.method not in ("POST", "PUT", "PATCH", "DELETE") and declared is None:
            return await call_next(request)
        size, chunks = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_request_bytes:
                chunks = []
                if size > 16 * limits.max_request_bytes:
                    too_big.headers["Connection"] = "close"
                    break
            else:
                chunks.append(chunk)
        if size > limits.max_request_bytes or (declared is not None and not declared.isdigit()):
            return too_big
        request._body = b"".join(chunks)  # starlette reads the cached body downstream
        return await call_next(request)

    def client_of(request: Request) -> str:
        """The caller's name (its token's), 401 without a valid bearer token; the peer address when open."""
        if not tokens:
            return request.client.host if request.client else "anonymous"
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and given:
            for token, name in tokens.items():  # compare_digest against each: no timing oracle on a prefix
                if hmac.compare_digest(given.encode(), token.encode()):
                    return name
        raise HTTPException(401, "a valid bearer token is required (Authorization: Bearer <token>)",
                            headers={"WWW-Authenticate": "Bearer"})

    def session(request: Request, sid: str) -> tuple[str, Session]:
        client = client_of(request)
        try:
            return client, store.get(sid, request.headers.get(SESSION_HEADER))
        except KeyError:
            raise HTTPException(404, f"no session {sid}") from None
        except PermissionError:
            raise HTTPException(403, f"session {sid}: missing or wrong {SESSION_HEADER} (the token POST /sessions "
                                "returned)") from None

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:  # on the event loop: never waits behind the executor
        return {"ok": True, "sessions": store.count(), "world": world_digest,
                "running": pool.running, "pending": pool.pending, "workers": limits.workers}

    @app.get("/tools")
    async def tools(request: Request) -> list[dict[str, Any]]:
        client_of(request)
        return catalogue

    @app.post("/sessions")
    async def create(request: Request, body: dict[str, Any] = Body(default={})) -> dict[str, str]:  # noqa: B008
        client = client_of(request)
        fmt = body.get("action_format")
        if fmt not in (None, "json", "code"):
            raise HTTPException(422, "action_format must be 'json' or 'code'")
        try:
            sid, token = await pool.run(client, store.create, fmt, client)
        except OverflowError as exc:
            raise HTTPException(429, str(exc)) from None
        return {"session": sid, "token": token}

    def _reset(s: Session, task: Task) -> dict[str, Any]:
        with s.lock:
            obs = s.env.reset(task)
            return {"observation": obs, "system_prompt": getattr(s.env, "system_prompt", ""),
                    "tools": list(getattr(s.env, "tools", None) or [])}

    @app.post("/sessions/{sid}/reset")
    async def reset(sid: str, request: Request, body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        client, s = session(request, sid)
        try:
            task = from_record(Task, body.get("task"))
            if environment is None:  # the workspace's setup options, capped
                check_options(task.options, limits.max_setup_items)
        except ValueError as exc:
            raise HTTPException(422, f"task: {str(exc)[:500]}") from None
        return await pool.run(client, _reset, s, task)

    def _step(s: Session, action: str) -> dict[str, Any]:
        with s.lock:
            return s.env.step(action).to_dict()

    @app.post("/sessions/{sid}/step")
    async def step(sid: str, request: Request, body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        client, s = session(request, sid)
        action = body.get("action")
        if not isinstance(action, str):
            action = "" if action is None else str(action)[: limits.max_action_chars]
        return await pool.run(client, _step, s, action[: limits.max_action_chars])

    def _verify(s: Session) -> dict[str, Any]:
        with s.lock:
            if getattr(s.env, "task", None) is None:
                return {}
            info = s.env.episode_info() if hasattr(s.env, "episode_info") else {}
            return {"verdict": asdict(s.env.verify()), "episode": info}

    @app.post("/sessions/{sid}/verify")
    async def verify(sid: str, request: Request) -> dict[str, Any]:
        client, s = session(request, sid)
        out = await pool.run(client, _verify, s)
        if not out:
            raise HTTPException(409, "reset the session first")
        return out

    @app.get("/sessions/{sid}/skills")
    async def skills(sid: str, request: Request) -> dict[str, Any]:
        _, s = session(request, sid)
        if not hasattr(s.env, "library"):
            raise HTTPException(404, "this environment keeps no skill library")
        return {"skills": [asdict(k) for k in list(s.env.library.skills)]}

    @app.delete("/sessions/{sid}")
    async def delete(sid: str, request: Request) -> dict[str, bool]:
        client, _ = session(request, sid)
        if not await pool.run(client, store.delete, sid):
            raise HTTPException(404, f"no session {sid}")
        return {"deleted": True}

    return app


def serve(host: str = "127.0.0.1", port: int = 8080, world: World | None = None, cfg: SandboxConfig | None = None,
          rewards: RewardConfig | None = None, workers_log_level: str = "warning", token_file: str | None = None,
          environment: Any = None) -> None:
    import uvicorn

    tokens = load_tokens(token_file)
    if not tokens and not is_loopback(host):
        raise ValueError(f"sandbox serve on {host}: no tokens (set {TOKENS_ENV} or --token-file); "
                         "without them the server only binds a loopback address")
    uvicorn.run(create_app(world, cfg, rewards, tokens, environment), host=host, port=port,
                log_level=workers_log_level)


class HTTPEnvironment:
    """The Environment protocol over HTTP: a session on a sandbox server. `token`: the bearer token (default:
    $AGENTRL_SANDBOX_TOKEN). A 503/429 (server busy) is retried after its Retry-After, `retries` times."""

    def __init__(self, base_url: str, action_format: str | None = None, timeout_s: float = 30.0,
                 token: str | None = None, retries: int = 5) -> None:
        import requests

        self.base = base_url.rstrip("/")
        self.http = requests.Session()
        token = token if token is not None else os.environ.get(CLIENT_TOKEN_ENV)
        if token:
            self.http.headers["Authorization"] = f"Bearer {token}"
        self.timeout, self.retries = timeout_s, retries
        self.system_prompt = ""
        self.tools: list[dict[str, Any]] = []
        out = self._call("POST", f"{self.base}/sessions", {"action_format": action_format})
        self.session = out["session"]
        self.http.headers[SESSION_HEADER] = out["token"]

    def _call(self, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            r = self.http.request(method, url, json=body, timeout=self.timeout)
            if r.status_code in (429, 503) and "Retry-After" in r.headers and attempt < self.retries:
                time.sleep(min(float(r.headers["Retry-After"]), 10.0) * (attempt + 1))
                continue
            r.raise_for_status()
            return r.json()
        raise AssertionError("unreachable")

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._call("POST", f"{self.base}/sessions/{self.session}/{path}", body or {})

    def reset(self, task: Task) -> str:
        out = self._post("reset", {"task": to_record(task)})
        self.system_prompt = out["system_prompt"]
        self.tools = list(out.get("tools") or [])
        return out["observation"]

    def step(self, action_text: str) -> StepResult:
        return StepResult.from_dict(self._post("step", {"action": action_text}))

    def verify(self) -> Verdict:
        out = self._post("verify")
        self.last_episode = out["episode"]
        return Verdict(**out["verdict"])

    def skills(self) -> list[dict[str, Any]]:
        return self._call("GET", f"{self.base}/sessions/{self.session}/skills")["skills"]

    def close(self) -> None:
        try:
            self.http.delete(f"{self.base}/sessions/{self.session}", timeout=self.timeout)
        finally:
            self.http.close()
