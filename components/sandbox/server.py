"""The sandbox over HTTP (the Kubernetes sandbox Deployment), and a client with the Environment protocol.

Same contract as the in-process WorkspaceEnv: a session is one environment (its own episode state,
code worker and skill library); many sessions are served concurrently. FastAPI + uvicorn do the
serving.

    POST   /sessions                     {"action_format": "json"|"code"}  -> {"session": id}
    POST   /sessions/{id}/reset          {"task": <Task record>}          -> {"observation", "system_prompt"}
    POST   /sessions/{id}/step           {"action": text}                 -> StepResult
    POST   /sessions/{id}/verify                                          -> {"verdict", "episode"}
    GET    /sessions/{id}/skills                                          -> the session's skill library
    DELETE /sessions/{id}
    GET    /healthz, GET /tools
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import asdict
from typing import Any

from components.core.config import RewardConfig, SandboxConfig
from components.core.env import StepResult
from components.core.schema import Task, Verdict, from_record, to_record
from components.sandbox.apis import CATALOGUE
from components.sandbox.env import WorkspaceEnv
from components.sandbox.skills import SkillLibrary
from components.sandbox.world import World, generate_world


class SessionStore:
    def __init__(self, world: World, cfg: SandboxConfig, rewards: RewardConfig, max_sessions: int, idle_s: float):
        self.world, self.cfg, self.rewards = world, cfg, rewards
        self.max_sessions, self.idle_s = max_sessions, idle_s
        self.sessions: dict[str, tuple[WorkspaceEnv, threading.Lock, list[float]]] = {}
        self.lock = threading.Lock()

    def create(self, action_format: str | None) -> str:
        self.expire()
        with self.lock:
            if len(self.sessions) >= self.max_sessions:
                raise OverflowError(f"too many sessions (limit {self.max_sessions})")
            sid = uuid.uuid4().hex
            env = WorkspaceEnv(self.world, self.cfg, self.rewards, SkillLibrary(), action_format)
            self.sessions[sid] = (env, threading.Lock(), [time.monotonic()])
            return sid

    def get(self, sid: str):
        with self.lock:
            if sid not in self.sessions:
                raise KeyError(sid)
            env, lock, seen = self.sessions[sid]
            seen[0] = time.monotonic()
            return env, lock

    def delete(self, sid: str) -> bool:
        with self.lock:
            item = self.sessions.pop(sid, None)
        if item:
            item[0].close()
        return item is not None

    def expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            stale = [sid for sid, (_, _, seen) in self.sessions.items() if now - seen[0] > self.idle_s]
        for sid in stale:
            self.delete(sid)

    def close(self) -> None:
        for sid in list(self.sessions):
            self.delete(sid)


def create_app(world: World | None = None, cfg: SandboxConfig | None = None, rewards: RewardConfig | None = None,
               max_sessions: int = 256, idle_s: float = 900.0):
    from fastapi import Body, FastAPI, HTTPException

    cfg = cfg or SandboxConfig()
    store = SessionStore(world if world is not None else generate_world(cfg), cfg, rewards or RewardConfig(),
                         max_sessions, idle_s)
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        yield
        store.close()  # stop every session's code worker

    from fastapi import Request
    from fastapi.responses import JSONResponse

    class EscapedJSON(JSONResponse):
        """ASCII JSON: a lone surrogate that reached a reply (from a client's own task text) is written as an
        escape, not a UnicodeEncodeError and a 500."""

        def render(self, content: Any) -> bytes:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")

    app = FastAPI(title="agentrl sandbox", version="1", lifespan=lifespan, default_response_class=EscapedJSON)
    app.state.store = store

    @app.exception_handler(ValueError)
    async def bad_input(_request: Request, exc: ValueError):  # a body FastAPI could not read (e.g. a 5,000-digit int)
        return EscapedJSON({"detail": f"bad request: {str(exc)[:300]}"}, status_code=422)

    @app.exception_handler(RecursionError)
    async def too_deep(_request: Request, _exc: RecursionError):
        return EscapedJSON({"detail": "bad request: nested too deeply"}, status_code=422)

    def session(sid: str):
        try:
            return store.get(sid)
        except KeyError:
            raise HTTPException(404, f"no session {sid}") from None

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True, "sessions": len(store.sessions), "world": store.world.digest()[:16]}

    @app.get("/tools")
    def tools() -> list[dict[str, Any]]:
        return [{"name": t.name, "description": t.description, "params": [asdict(p) for p in t.params]} for t in CATALOGUE]

    @app.post("/sessions")
    def create(body: dict[str, Any] = Body(default={})) -> dict[str, str]:  # noqa: B008
        fmt = body.get("action_format")
        if fmt not in (None, "json", "code"):
            raise HTTPException(422, "action_format must be 'json' or 'code'")
        try:
            return {"session": store.create(fmt)}
        except OverflowError as exc:
            raise HTTPException(429, str(exc)) from None

    @app.post("/sessions/{sid}/reset")
    def reset(sid: str, body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        env, lock = session(sid)
        try:
            task = from_record(Task, body.get("task"))
        except ValueError as exc:
            raise HTTPException(422, f"task: {exc}") from None
        with lock:
            obs = env.reset(task)
            return {"observation": obs, "system_prompt": env.system_prompt}

    @app.post("/sessions/{sid}/step")
    def step(sid: str, body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        env, lock = session(sid)
        action = body.get("action")
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        with lock:
            return env.step(action).to_dict()

    @app.post("/sessions/{sid}/verify")
    def verify(sid: str) -> dict[str, Any]:
        env, lock = session(sid)
        with lock:
            if env.task is None:
                raise HTTPException(409, "reset the session first")
            verdict = env.verify()
            return {"verdict": asdict(verdict), "episode": env.episode_info()}

    @app.get("/sessions/{sid}/skills")
    def skills(sid: str) -> dict[str, Any]:
        env, _ = session(sid)
        return {"skills": [asdict(s) for s in env.library.skills]}

    @app.delete("/sessions/{sid}")
    def delete(sid: str) -> dict[str, bool]:
        if not store.delete(sid):
            raise HTTPException(404, f"no session {sid}")
        return {"deleted": True}

    return app


def serve(host: str = "127.0.0.1", port: int = 8080, world: World | None = None, cfg: SandboxConfig | None = None,
          rewards: RewardConfig | None = None, workers_log_level: str = "warning") -> None:
    import uvicorn

    uvicorn.run(create_app(world, cfg, rewards), host=host, port=port, log_level=workers_log_level)


class HTTPEnvironment:
    """The Environment protocol over HTTP: a session on a sandbox server."""

    def __init__(self, base_url: str, action_format: str | None = None, timeout_s: float = 30.0) -> None:
        import requests

        self.base = base_url.rstrip("/")
        self.http = requests.Session()
        self.timeout = timeout_s
        self.system_prompt = ""
        r = self.http.post(f"{self.base}/sessions", json={"action_format": action_format}, timeout=timeout_s)
        r.raise_for_status()
        self.session = r.json()["session"]

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.http.post(f"{self.base}/sessions/{self.session}/{path}", json=body or {}, timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    def reset(self, task: Task) -> str:
        out = self._post("reset", {"task": to_record(task)})
        self.system_prompt = out["system_prompt"]
        return out["observation"]

    def step(self, action_text: str) -> StepResult:
        return StepResult.from_dict(self._post("step", {"action": action_text}))

    def verify(self) -> Verdict:
        out = self._post("verify")
        self.last_episode = out["episode"]
        return Verdict(**out["verdict"])

    def skills(self) -> list[dict[str, Any]]:
        r = self.http.get(f"{self.base}/sessions/{self.session}/skills", timeout=self.timeout)
        r.raise_for_status()
        return r.json()["skills"]

    def close(self) -> None:
        try:
            self.http.delete(f"{self.base}/sessions/{self.session}", timeout=self.timeout)
        finally:
            self.http.close()
