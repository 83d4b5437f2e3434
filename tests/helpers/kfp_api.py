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
        self.pipelines: dict[str, dict] = {}
        self.recurring: dict[str, dict] = {}
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
                except ValueError:  # a multipart upload: keep the pipeline YAML's bytes
                    body = raw.decode(errors="replace")
                recorder.requests.append({"method": method, "path": url.path, "query": parse_qs(url.query),
                                          "body": body})
                code, out = recorder.answer(method, url.path, parse_qs(url.query), body)
                self._reply(code, out)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_DELETE(self):
                self._handle("DELETE")

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
            job = dict(body, recurring_run_id=uuid.uuid4().hex, status="ENABLED")
            self.recurring[job["recurring_run_id"]] = job
            return 200, job
        if path == "/apis/v2beta1/recurringruns" and method == "GET":
            flt = json.loads(query.get("filter", ["{}"])[0] or "{}")
            names = [p.get("string_value") or p.get("stringValue") for p in flt.get("predicates", [])]
            found = [j for j in self.recurring.values() if not names or j["display_name"] in names]
            return 200, {"recurringRuns": found, "total_size": len(found)}
        if path.startswith("/apis/v2beta1/recurringruns/") and method == "DELETE":
            self.recurring.pop(path.rsplit("/", 1)[1], None)
            return 200, {}
        if path == "/apis/v2beta1/pipelines" and method == "GET":
            flt = json.loads(query.get("filter", ["{}"])[0] or "{}")
            names = [p.get("string_value") or p.get("stringValue") for p in flt.get("predicates", [])]
            found = [p for p in self.pipelines.values() if p["display_name"] in names]
            return 200, {"pipelines": found, "total_size": len(found)}
        if path == "/apis/v2beta1/pipelines/upload" and method == "POST":
            pipe = {"pipeline_id": uuid.uuid4().hex, "display_name": query["name"][0]}
            self.pipelines[pipe["pipeline_id"]] = pipe
            return 200, pipe
        if path == "/apis/v2beta1/pipelines/upload_version" and method == "POST":
            return 200, {"pipeline_id": query["pipelineid"][0], "pipeline_version_id": uuid.uuid4().hex,
                         "display_name": query["name"][0]}
        return 404, {"error": f"not recorded: {method} {path}", "code": 5}

    def __enter__(self) -> KFPRecorder:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
