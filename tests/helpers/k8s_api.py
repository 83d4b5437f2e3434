"""A local HTTP server answering the few Kubernetes API calls the job launcher makes, recording them.

Jobs move through the states a test scripts (`states`: one per status read); pods and their logs are
served for the job's label selector; logs grow with each read, as a running pod's do.
"""

from __future__ import annotations

from tests.helpers.recording import RecordingServer


class K8sRecorder(RecordingServer):
    def __init__(self, states: list[str] = (), log_lines: list[str] = (), execute_env: dict | None = None) -> None:
        """`execute_env`: run each created job's command here, for real (torchrun -> one local process),
        with this environment; its state follows the process and its output is the pod's log."""
        self.execute_env = execute_env
        self.procs: dict[str, tuple] = {}
        self.states, self.log_lines = list(states), list(log_lines)
        self.jobs: dict[str, dict] = {}
        self.reads = 0
        super().__init__()

    def _run(self, job: dict) -> None:
        import subprocess
        import sys
        import tempfile

        spec = job["spec"]["trainer"] if job["kind"] == "TrainJob" else \
            job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        cmd = list(spec["command"])
        if cmd[0] == "torchrun":  # one node, one process, on this machine
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *cmd[2:]]
        env = dict(self.execute_env, **{e["name"]: e["value"] for e in spec.get("env", [])})
        log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        self.procs[job["metadata"]["name"]] = (proc, log.name)

    def _status(self, name: str = "") -> dict:
        if name in self.procs:
            rc = self.procs[name][0].poll()
            if rc is None:
                return {"conditions": []}
            if rc == 0:
                return {"conditions": [{"type": "Complete", "status": "True"}]}
            return {"conditions": [{"type": "Failed", "status": "True", "reason": "Error", "message": f"exit {rc}"}]}
        state = self.states[min(self.reads, len(self.states) - 1)]
        self.reads += 1
        if state == "Running":
            return {"conditions": []}
        if state == "Failed":
            return {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                    "message": "node 1 exited with code 1"}]}
        return {"conditions": [{"type": state, "status": "True"}]}

    def answer(self, method: str, path: str, query: dict, body):
        parts = path.strip("/").split("/")
        if method == "POST" and parts[0] == "apis":  # create a custom object
            self.jobs[body["metadata"]["name"]] = body
            if self.execute_env is not None:
                self._run(body)
            return 201, body, "application/json"
        if method == "GET" and parts[0] == "apis" and parts[-1] in self.jobs:
            return 200, dict(self.jobs[parts[-1]], status=self._status(parts[-1])), "application/json"
        if method == "DELETE" and parts[0] == "apis":
            self.jobs.pop(parts[-1], None)
            return 200, {"kind": "Status", "status": "Success"}, "application/json"
        if method == "GET" and path.endswith("/pods"):
            name = next(iter(self.jobs), "none")
            pod = {"metadata": {"name": f"{name}-node-0-0", "namespace": parts[3]}}
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": [pod]}, "application/json"
        if method == "GET" and path.endswith("/log") and self.procs:
            proc, log = next(iter(self.procs.values()))
            with open(log) as fh:
                return 200, fh.read(), "text/plain"
        if method == "GET" and path.endswith("/log"):
            shown = min(len(self.log_lines), self.reads)
            return 200, "".join(x + "\n" for x in self.log_lines[:shown]), "text/plain"
        return 404, {"kind": "Status", "code": 404}, "application/json"

    def stop_extra(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def api_client(self):
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)
