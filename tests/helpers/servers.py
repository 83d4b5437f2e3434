"""Real servers on 127.0.0.1 for tests: moto's S3, an MLflow tracking server, and a fault proxy.

Every server is started in its own process group and stopped (the whole group) by its owner.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}\n{tail}")
        try:
            requests.get(url, timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group: mlflow leaves a _job_runner child behind
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


class MotoServer:
    """moto's standalone S3 server."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = workdir / f"moto-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> MotoServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        _wait_http(self.url, self.proc, 30, self.log)
        return self

    def stop(self) -> None:
        _stop(self.proc)


class MlflowServer:
    """`mlflow server` with a sqlite backend and artifacts proxied into an S3 bucket."""

    def __init__(self, workdir: Path, s3_endpoint: str, bucket: str) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.db = workdir / "mlflow.db"
        self.s3_endpoint = s3_endpoint
        self.bucket = bucket
        self.log = workdir / f"mlflow-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> MlflowServer:
        env = dict(os.environ, MLFLOW_S3_ENDPOINT_URL=self.s3_endpoint)
        mlflow = Path(sys.executable).with_name("mlflow")
        self.proc = subprocess.Popen(
            [str(mlflow), "server", "--host", HOST, "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.db}",
             "--artifacts-destination", f"s3://{self.bucket}/mlartifacts",
             "--workers", "1"],
            stdout=open(self.log, "a"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        _wait_http(self.url + "/health", self.proc, 90, self.log)
        return self

    def stop(self) -> None:
        _stop(self.proc)


class FaultProxy:
    """An HTTP proxy to `upstream` that can answer 503 SlowDown to chosen requests, or die.

    `fail_every=n`: every n-th request gets a 503 (S3's throttling answer) instead of being forwarded.
    """

    def __init__(self, upstream: str, fail_every: int = 0) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.fail_every = fail_every
        self.requests = 0
        self.failed = 0
        self.forwarded = 0
        self.dead = False
        self.drop_responses = 0  # forward the next n requests, then drop the connection unanswered
        self.dropped = 0
        self.hold: threading.Event | None = None  # set to an unset Event: requests wait (a hung server) until it is set
        self.held = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                if proxy.dead:  # a dead server answers nothing: the client sees the connection drop
                    self.close_connection = True
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                hold = proxy.hold
                if hold is not None and not hold.is_set():
                    with proxy._lock:
                        proxy.held += 1
                    hold.wait(120)
                with proxy._lock:
                    proxy.requests += 1
                    fail = proxy.fail_every and proxy.requests % proxy.fail_every == 0
                    if fail:
                        proxy.failed += 1
                if fail:
                    payload = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                               b"<Message>Please reduce your request rate.</Message></Error>")
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                with proxy._lock:
                    proxy.forwarded += 1
                    drop = proxy.drop_responses > 0
                    if drop:
                        proxy.drop_responses -= 1
                        proxy.dropped += 1
                if drop:  # the server did the work; the client never hears back
                    conn.close()
                    self.close_connection = True
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{HOST}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.dead = True
        self.server.shutdown()
        self.server.server_close()

    kill = stop
