"""A local HTTP server that answers the Kubeflow Pipelines v2beta1 REST API just enough for the SDK client,
and records every request (method, path, query, JSON body) for the tests to assert on."""

from __future__ import annotations

import json
import uuid

from tests.helpers.recording import RecordingServer


class KFPRecorder(RecordingServer):
    def __init__(self) -> None:
        super().__init__()
        self.experiments: dict[str, dict] = {}
        self.pipelines: dict[str, dict] = {}
        self.recurring: dict[str, dict] = {}

    def answer(self, method: str, path: str, query: dict, body):
        code, out = self._answer(method, path, query, body)
        return code, out, "application/json"

    def _answer(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
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
