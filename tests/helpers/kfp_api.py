"""A local HTTP server that answers the Kubeflow Pipelines v2beta1 REST API just enough for the SDK client,
and records every request (method, path, query, JSON body) for the tests to assert on."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class KFPRecorder:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.experiments: dict[str, dict] = {}
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                recorder.requests.append({"method": method, "path": url.path, "query": parse_qs(url.query),
                                          "body": body})
                code, out = recorder.answer(method, url.path, parse_qs(url.query), body)
                self._reply(code, out)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
        if path.endswith("/healthz"):
            return 200, {"multi_user": False}
        if path == "/apis/v2beta1/experiments" and method == "GET":
            flt = json.loads(query.get("filter", ["{}"])[0] or "{}")
            names = [p.get("string_value") or p.get("stringValue") for p in flt.get("predicates", [])]
            found = [e for e in self.experiments.values() if e["display_name"] in names] if names else list(
                self.experiments.values())
            return 200, {"experiments": found, "total_size": len(found)}
        if path == "/apis/v2beta1/experiments" and method == "POST":
            exp = {"experiment_id": uuid.uuid4().hex, "display_name": body["display_name"],
                   "namespace": body.get("namespace")}
            self.experiments[exp["experiment_id"]] = exp
            return 200, exp
        if path == "/apis/v2beta1/runs" and method == "POST":
            return 200, dict(body, run_id=uuid.uuid4().hex, state="PENDING")
        if path == "/apis/v2beta1/recurringruns" and method == "POST":
            return 200, dict(body, recurring_run_id=uuid.uuid4().hex, status="ENABLED")
        return 404, {"error": f"not recorded: {method} {path}", "code": 5}

    def __enter__(self) -> KFPRecorder:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
