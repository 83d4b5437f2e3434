"""MLflow runs for phases: one run per phase nested under one parent run per pipeline run.

Where the run comes from, in order:
1. `MLFLOW_RUN_ID` injected by KFP >= 2.17's MLflow plugin (it made the nested run for this task);
2. a parent run id passed down by the pipeline: a nested phase run is created under it;
3. nothing: a parent run is created, and the phase run under it.

Metric keys are `<phase>/<name>`, step = optimizer step. Params are the flattened resolved config with
secrets scrubbed. Logging never waits on the server: metrics are appended to a buffer file on disk and
a background sender sends them; while the server is unreachable it retries with backoff (one warning
per outage) and the phase trains on. A batch may have reached the server before its connection
failed, so a batch sent again is de-duplicated against the server's history: none lost, none doubled.
Tags, artifacts and the run's final status wait in the same directory while the server is down. A phase
that ends with something still buffered says so; the next phase (any run on the same home) or
`agentrl flush` sends it. (MLflow's own async logging keeps its queue in memory only, hence this layer.)
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from components.core import storage
from components.core.config import PipelineConfig, flatten

log = logging.getLogger("agentrl.tracking")

__all__ = ["NullRun", "phase_run", "rank", "start_pipeline_run", "end_run", "ensure_experiment", "PhaseRun", "resolve_tracking_uri", "scrub", "local_tracking_uri", "MetricBuffer", "Registry", "flush_pending", "finish_pipeline_runs"]

_SECRET_KEY = re.compile(
    r"(^|[._-])(secret|secrets|password|passwd|pwd|token|api[_-]?key|access[_-]?key|secret[_-]?key|"
    r"credentials?|auth|session[_-]?token|private[_-]?key)$",
    re.IGNORECASE,
)
_URL_CREDS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]+):(?P<pw>[^@/\s]+)@", re.IGNORECASE)
REDACTED = "***"


def scrub(params: Mapping[str, Any]) -> dict[str, Any]:
    """Drop secret values: keys that name a secret, and passwords inside URLs."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        if _SECRET_KEY.search(str(k)):
            out[k] = REDACTED
        elif isinstance(v, str):
            out[k] = _URL_CREDS.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", v)
        else:
            out[k] = v
    return out


def agentrl_home() -> Path:
    return Path(os.environ.get("AGENTRL_HOME", ".agentrl")).resolve()


def local_tracking_uri(home: str | os.PathLike | None = None) -> str:
    h = Path(home).resolve() if home else agentrl_home()
    h.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{h / 'mlflow.db'}"


def resolve_tracking_uri(explicit: str | None = None, home: str | os.PathLike | None = None) -> str:
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or local_tracking_uri(home)


def _is_unreachable(exc: BaseException) -> bool:
    """True for connection-level failures and 5xx answers (the server is down or restarting)."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, MlflowException):
        text = str(exc)
        if "API request to" in text and "failed with exception" in text:
            return True  # mlflow's wrapper around connection errors and exhausted 5xx retries
        if getattr(exc, "get_http_status_code", lambda: 0)() >= 500:
            return True
    return False


class MetricBuffer:
    """Metrics that could not be sent yet, on disk, one JSON line each ({key, value, step, timestamp})."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, metrics: list[dict[str, Any]]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            for m in metrics:
                fh.write(json.dumps(m) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def load(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line torn by a crash mid-write: the rest is good
                    log.warning("metric buffer %s: dropping a torn line", self.path)
        return out

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def take(self, dest: Path) -> bool:
        """Move the buffer to `dest` (the batch being sent) unless `dest` still holds an unsent one."""
        if dest.exists() or not self.path.exists():
            return False
        os.replace(self.path, dest)
        return True

    def __len__(self) -> int:
        return len(self.load())


def _dedup(client, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics of `batch` the server does not have yet (a batch sent again may have partly arrived)."""
    seen: set[tuple[str, int, int, float]] = set()
    run_ids = {m["run_id"] for m in batch}
    for run_id in run_ids:
        for k in {m["key"] for m in batch if m["run_id"] == run_id}:
            for h in client.get_metric_history(run_id, k):
                seen.add((k, int(h.step), int(h.timestamp), float(h.value)))
    fresh, dedup = [], set()
    for m in batch:
        ident = (m["key"], int(m["step"]), int(m["timestamp"]), float(m["value"]))
        if ident not in seen and ident not in dedup:
            dedup.add(ident)
            fresh.append(m)
    return fresh


class Outbox:
    """What one run has not sent yet, on disk under the buffer directory: metrics (`<run>.jsonl`, and the
    batch in flight `<run>.sending.jsonl`), other calls in order (`<run>.ops.jsonl`: tags, artifacts kept in
    `<run>.artifacts/`, final statuses) and `<run>.meta.json` (where it goes). Any process can send it."""

    def __init__(self, root: Path, run_id: str, tracking_uri: str) -> None:
        self.root, self.run_id, self.tracking_uri = Path(root), run_id, tracking_uri
        self.metrics = MetricBuffer(self.root / f"{run_id}.jsonl")
        self.sending = self.root / f"{run_id}.sending.jsonl"
        self.ops = self.root / f"{run_id}.ops.jsonl"
        self.artifacts = self.root / f"{run_id}.artifacts"
        self.meta = self.root / f"{run_id}.meta.json"
        self.lock = threading.Lock()  # guards the files
        self.send_lock = threading.Lock()  # one sender at a time (the background one, flush(), flush_pending)
        self.retry = self.sending.exists()  # left by an earlier attempt: it may have partly reached the server

    def open(self, ended: bool = False) -> Outbox:
        """Write who owns this outbox: while its process lives and has not ended the run, no one else sends it
        (two senders of one batch would double it)."""
        import socket

        self.meta.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": self.tracking_uri, "pid": os.getpid(),
                                         "host": socket.gethostname(), "ended": ended}))
        return self

    @staticmethod
    def owned_elsewhere(info: dict[str, Any]) -> bool:
        """True while the run's own process (alive, on this host) may still be sending it."""
        import socket

        if info.get("ended") or info.get("host") != socket.gethostname() or not info.get("pid"):
            return False
        try:
            os.kill(int(info["pid"]), 0)
        except (ProcessLookupError, PermissionError, ValueError):
            return False
        return True

    def add_metrics(self, batch: list[dict[str, Any]]) -> None:
        with self.lock:
            if not self.meta.exists():  # sent empty before: its owner is named again
                self.open()
            self.metrics.append([{**m, "run_id": self.run_id} for m in batch])

    def add_op(self, op: dict[str, Any]) -> None:
        with self.lock:
            if not self.meta.exists():
                self.open()
            with open(self.ops, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(op) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    def keep_artifact(self, local: str, artifact_path: str | None) -> None:
        n = len(list(self.artifacts.glob("*"))) if self.artifacts.exists() else 0
        dest = self.artifacts / f"{n}" / Path(local).name
        dest.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if Path(local).is_dir() else shutil.copyfile)(local, dest)
        self.add_op({"op": "artifact", "run_id": self.run_id, "local": str(dest), "path": artifact_path})

    def _ops(self) -> list[dict[str, Any]]:
        return MetricBuffer(self.ops).load() if self.ops.exists() else []

    def pending(self) -> tuple[int, int]:
        """(metrics, other calls) not sent yet."""
        with self.lock:
            n = len(self.metrics) + (len(MetricBuffer(self.sending)) if self.sending.exists() else 0)
            return n, len(self._ops())

    def empty(self) -> bool:
        return self.pending() == (0, 0)

    def send(self, client) -> None:
        """Send everything pending: metrics first, then the other calls in order. Raises what the client raised
        (nothing is lost: what was not confirmed stays on disk)."""
        with self.send_lock:
            self._send(client)

    def _send(self, client) -> None:
        from mlflow.entities import Metric

        while True:
            with self.lock:
                if not self.sending.exists():
                    if not self.metrics.take(self.sending):
                        break
                    self.retry = False
            batch = MetricBuffer(self.sending).load()
            if self.retry:
                batch = _dedup(client, batch)
            self.retry = True  # until confirmed
            for i in range(0, len(batch), 1000):
                chunk = batch[i : i + 1000]
                for run_id in dict.fromkeys(m["run_id"] for m in chunk):
                    client.log_batch(run_id, metrics=[Metric(m["key"], m["value"], m["timestamp"], m["step"])
                                                      for m in chunk if m["run_id"] == run_id])
            self.sending.unlink()
            self.retry = False
        with self.lock:
            ops = self._ops()
        done = 0
        try:
            for op in ops:
                if op["op"] == "tag":
                    client.set_tag(op["run_id"], op["key"], op["value"])
                elif op["op"] == "artifact":
                    local = op["local"]
                    if Path(local).is_dir():
                        client.log_artifacts(op["run_id"], local, op["path"])
                    else:
                        client.log_artifact(op["run_id"], local, op["path"])
                elif op["op"] == "terminate":
                    client.set_terminated(op["run_id"], status=op["status"])
                done += 1
        finally:
            if done:
                with self.lock:  # drop what was applied; calls added meanwhile stay
                    rest = self._ops()[done:]
                    tmp = self.ops.with_suffix(".tmp")
                    tmp.write_text("".join(json.dumps(o) + "\n" for o in rest))
                    os.replace(tmp, self.ops)
        with self.lock:
            if not self.metrics.path.exists() and not self.sending.exists() and not self._ops():
                self.ops.unlink(missing_ok=True)
                shutil.rmtree(self.artifacts, ignore_errors=True)
                self.meta.unlink(missing_ok=True)


class _Sender(threading.Thread):
    """Sends a run's outbox in the background, so that a log call never waits on the server: woken by each
    log call, it retries with backoff (1 s doubling to 30 s) while the server is unreachable."""

    def __init__(self, run: PhaseRun, outbox: Outbox) -> None:
        super().__init__(name=f"mlflow-sender-{run.phase}", daemon=True)
        self.run_, self.outbox = run, outbox
        self.wake_ev = threading.Event()
        self.stopping = threading.Event()
        self.down = False
        self.error: BaseException | None = None
        self.deadline = float("inf")
        self.attempts = 0
        self.in_flight = False
        self.leftovers = True  # first: what earlier runs on this home left buffered

    def wake(self) -> None:
        self.wake_ev.set()

    def run(self) -> None:
        backoff = 1.0
        while True:
            self.wake_ev.wait(timeout=backoff if self.down else None)
            self.wake_ev.clear()
            try:
                if self.leftovers:
                    self.leftovers = False
                    flush_pending(self.outbox.root, self.outbox.tracking_uri, exclude={self.outbox.run_id}, quiet=True)
                self.attempts += 1
                self.in_flight = True
                try:
                    self.outbox.send(self.run_.client)
                finally:
                    self.in_flight = False
                if self.down:
                    log.warning("MLflow tracking server is back: buffered metrics sent")
                self.down, backoff = False, 1.0
            except Exception as exc:  # noqa: BLE001 - the phase goes on; the data stays on disk
                if not _is_unreachable(exc):
                    log.error("MLflow refused a buffered call of %s (%s: %s); it stays in %s", self.run_.phase,
                              type(exc).__name__, str(exc)[:300], self.outbox.root)
                    self.error = exc
                elif not self.down:
                    warnings.warn(
                        f"MLflow tracking server {self.run_.tracking_uri} unreachable ({type(exc).__name__}); "
                        f"training goes on, metrics are buffered in {self.outbox.root} and sent when it is back",
                        RuntimeWarning, stacklevel=1)
                self.down, backoff = True, (min(backoff * 2, 30.0) if not self.stopping.is_set() else 0.5)
            if self.stopping.is_set() and (not self.down or time.monotonic() >= self.deadline or self.error):
                return

    def stop(self, timeout_s: float) -> None:
        """Send what is left, waiting at most `timeout_s` for an unreachable server."""
        self.deadline = time.monotonic() + timeout_s
        self.stopping.set()
        self.wake()
        self.join(timeout_s + 5.0)


class PhaseRun:
    """Context manager for one phase's MLflow run.

    >>> with PhaseRun("sft", config=cfg) as run:
    ...     run.log_metrics({"loss": 1.2}, step=1)      # -> key "sft/loss"
    """

    def __init__(
        self,
        phase: str,
        config: PipelineConfig | None = None,
        parent_run_id: str | None = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        buffer_dir: str | os.PathLike | None = None,
        close_parent: bool = True,
        resume_run_id: str | None = None,
    ) -> None:
        self.phase = phase
        self.resume_run_id = resume_run_id  # continue this run (a phase resumed from its checkpoint)
        self._logged_upto: dict[str, int] = {}  # log_new_metrics: the last step MLflow has, per key
        self.close_parent = close_parent
        self.config = config
        tcfg = config.tracking if config else None
        self.tracking_uri = resolve_tracking_uri(
            tracking_uri or (tcfg.tracking_uri if tcfg else None), config.run.home if config else None
        )
        self.experiment = experiment or (tcfg.experiment if tcfg else "agentrl")
        self.registered_model = tcfg.registered_model if tcfg else "agentrl-policy"
        self.parent_run_id = parent_run_id
        self.run_name = run_name or phase
        self.tags = dict(tags or {})
        if tcfg is not None and tcfg.kfp_run_id:  # which KFP run this is: in the MLflow UI and for the exit step
            self.tags.update({"kfp.run_id": tcfg.kfp_run_id, "kfp.pipeline": tcfg.kfp_pipeline})
        home = Path(config.run.home).resolve() if config else agentrl_home()
        self.buffer_root = Path(buffer_dir) if buffer_dir else home / "metric_buffer"
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.created_parent = False
        self._warned = False
        self._buffer: MetricBuffer | None = None
        self._outbox: Outbox | None = None
        self._sender: _Sender | None = None
        self.flush_timeout_s = tcfg.flush_timeout_s if tcfg else 30.0
        self.left_buffered: tuple[int, int] = (0, 0)  # (metrics, other calls) still on disk when the phase ended
        if tcfg is not None:
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(tcfg.request_timeout_s)))
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(tcfg.request_retries))
        else:
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def client(self):
        from mlflow import MlflowClient

        if not hasattr(self, "_client"):
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _experiment_id(self) -> str:
        return ensure_experiment(self.client, self.experiment, self.tracking_uri)

    def start(self) -> PhaseRun:
        injected = os.environ.get("MLFLOW_RUN_ID") or self.resume_run_id
        if injected:
            run = self.client.get_run(injected)
            self.run_id = injected
            self.experiment_id = run.info.experiment_id
            self.parent_run_id = run.data.tags.get("mlflow.parentRunId", self.parent_run_id)
            if self.resume_run_id and run.info.status != "RUNNING":
                self.client.update_run(injected, status="RUNNING")
        else:
            self.experiment_id = self._experiment_id()
            if not self.parent_run_id:
                kfp = {k: v for k, v in self.tags.items() if k.startswith("kfp.")}
                parent = self.client.create_run(
                    self.experiment_id, run_name="agentrl-pipeline", tags={"agentrl.kind": "pipeline", **kfp}
                )
                self.parent_run_id = parent.info.run_id
                self.created_parent = True
            tags = {"mlflow.parentRunId": self.parent_run_id, "agentrl.phase": self.phase, **self.tags}
            run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
            self.run_id = run.info.run_id
        os.environ["AGENTRL_PHASE"] = self.phase  # named in storage errors
        self._outbox = Outbox(self.buffer_root, self.run_id, self.tracking_uri).open()
        self._buffer = self._outbox.metrics
        self._sender = _Sender(self, self._outbox)
        self._sender.start()
        if self.config is not None and not self.resume_run_id:  # params are write-once in MLflow
            self.log_params(flatten(self.config.to_dict()))
        return self

    def log_new_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """`log_metrics` for a run resumed from a checkpoint: it re-computes the steps after the checkpoint,
        some of which the attempt before it logged already; those are not logged twice."""
        upto = self._logged_upto
        new = {k for k in metrics if k not in upto}
        if new:
            upto.update(self.last_steps(new))
        metrics = {k: v for k, v in metrics.items() if step > upto.get(k, -1)}
        if metrics:
            self.log_metrics(metrics, step=step)

    def last_steps(self, keys: set[str]) -> dict[str, int]:
        """The highest step logged so far for each key (a resumed run logs only later steps): on the server, or
        still in this run's outbox (an earlier attempt's tail that was not sent yet)."""
        queued: dict[str, int] = {}
        if self._outbox is not None:
            with self._outbox.lock:
                files = [self._outbox.metrics.path, self._outbox.sending]
                for m in (m for f in files if f.exists() for m in MetricBuffer(f).load()):
                    queued[m["key"]] = max(queued.get(m["key"], -1), int(m["step"]))
        out = {}
        for k in keys:
            hist = self.client.get_metric_history(self.run_id, self.key(k))
            out[k] = max(max((int(m.step) for m in hist), default=-1), queued.get(self.key(k), -1))
        return out

    def end(self, status: str = "FINISHED") -> None:
        if self.run_id is None or self._sender is None:
            return
        sender, self._sender = self._sender, None
        sender.stop(self.flush_timeout_s)
        ends = []
        if os.environ.get("MLFLOW_RUN_ID") != self.run_id:
            ends.append(self.run_id)
        if self.created_parent and self.close_parent:
            ends.append(self.parent_run_id)
        for run_id in ends:
            self._call({"op": "terminate", "run_id": run_id, "status": status}, queue_only=not self._outbox.empty())
        self.left_buffered = self._outbox.pending()
        if self.left_buffered != (0, 0):
            self._outbox.open(ended=True)  # from now on the next phase or `agentrl flush` may send it
        if self.left_buffered != (0, 0):
            n, ops = self.left_buffered
            log.warning(
                "%s ended with %d metrics and %d other tracking calls (tags, artifacts, run status) not sent: the MLflow "
                "server %s is unreachable. They are kept in %s; the next phase on this home or `agentrl flush` sends "
                "them.", self.phase, n, ops, self.tracking_uri, self._outbox.root,
            )
            print(f"agentrl: {self.phase}: {n} metrics and {ops} tracking calls still buffered in "
                  f"{self._outbox.root} (run `agentrl flush`)", file=__import__("sys").stderr, flush=True)
        if sender.error is not None:
            raise RuntimeError(f"MLflow refused a buffered call of {self.phase}: {sender.error}") from sender.error

    def _call(self, op: dict[str, Any], queue_only: bool = False) -> None:
        """Apply one tag/terminate call now, or keep it in the outbox when the server is (known to be) down."""
        if not queue_only and not (self._sender is not None and self._sender.down):
            try:
                if op["op"] == "tag":
                    self.client.set_tag(op["run_id"], op["key"], op["value"])
                else:
                    self.client.set_terminated(op["run_id"], status=op["status"])
                return
            except Exception as exc:
                if not _is_unreachable(exc):
                    raise
                self._warn(exc)
        self._outbox.add_op(op)
        if self._sender is not None:
            self._sender.wake()

    def __enter__(self) -> PhaseRun:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.run_id is not None:
            try:  # the phase's own error, for `agentrl run` and the MLflow UI (not only the runner's summary)
                self.set_tags({"agentrl.error": f"{exc_type.__name__}: {exc}"[:4000]})
            except Exception:  # noqa: BLE001 - never mask the real error
                log.warning("could not record the error of %s on its run", self.phase)
        self.end("FAILED" if exc_type else "FINISHED")

    # -- params, metrics ---------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        clean = scrub(params)
        items = [Param(str(k), str(v)[:6000]) for k, v in clean.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def key(self, name: str) -> str:
        return name if name.startswith(f"{self.phase}/") else f"{self.phase}/{name}"

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Log `<phase>/<name>` metrics; never raises when the server is unreachable (buffers instead)."""
        ts = int(time.time() * 1000)
        batch = [
            {"key": self.key(k), "value": float(v), "step": int(step), "timestamp": ts}
            for k, v in metrics.items()
            if v is not None
        ]
        self._send(batch)

    def log_metric(self, name: str, value: float, step: int = 0) -> None:
        self.log_metrics({name: value}, step=step)

    def _send(self, batch: list[dict[str, Any]]) -> None:
        assert self._outbox is not None, "PhaseRun not started"
        self._outbox.add_metrics(batch)  # on disk first: the background sender sends it; this never waits
        if self._sender is not None:
            self._sender.wake()

    def _warn(self, exc: BaseException) -> None:
        if self._sender is not None:
            self._sender.down = True  # the next calls go straight to the outbox
        if not self._warned:
            warnings.warn(
                f"MLflow tracking server {self.tracking_uri} unreachable ({type(exc).__name__}); "
                f"tracking calls are buffered in {self.buffer_root} and will be sent when it is back",
                RuntimeWarning,
                stacklevel=3,
            )
            self._warned = True

    def pending(self) -> tuple[int, int]:
        """(metrics, other tracking calls) not sent yet."""
        return self._outbox.pending() if self._outbox else (0, 0)

    def flush(self, final: bool = False) -> bool:
        """Send what is buffered now, in this thread. True when nothing is left pending."""
        if self._outbox is None:
            return True
        try:
            self._outbox.send(self.client)
        except Exception as exc:
            if not _is_unreachable(exc):
                raise
            self._warn(exc)
            return False
        return True

    # -- artifacts -----------------------------------------------------------------------------
    def _upload_artifact(self, local: str, artifact_path: str | None) -> None:
        if Path(local).is_dir():
            self.client.log_artifacts(self.run_id, local, artifact_path)
        else:
            self.client.log_artifact(self.run_id, local, artifact_path)

    def log_artifact(self, local: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Log a file or a directory; while the server is unreachable a copy is kept and uploaded later."""
        local = str(local)
        if not (self._sender is not None and self._sender.down):
            try:
                self._upload_artifact(local, artifact_path)
                return
            except Exception as exc:
                if not _is_unreachable(exc):
                    raise
                self._warn(exc)
        self._outbox.keep_artifact(local, artifact_path)
        if self._sender is not None:
            self._sender.wake()

    def artifact_uri(self, artifact_path: str = "") -> str:
        base = self.client.get_run(self.run_id).info.artifact_uri
        return f"{base}/{artifact_path}" if artifact_path else base

    def storage_uri(self, root: str, name: str = "") -> str:
        """Where this phase's own outputs live: <root>/<experiment>/<parent-run>/<phase>/<name>."""
        return storage.join(root, self.experiment, self.parent_run_id or self.run_id, self.phase, *(p for p in [name] if p))

    def store_model(self, model_dir: str | os.PathLike, root: str, card: Any = None) -> str:
        """Write `card` (if given) as the model's agentrl.json, store the directory under this phase's prefix,
        log the card and tag the run with the stored URI. Returns the URI."""
        if card is not None:
            from components.core.schema import to_record

            card_path = Path(model_dir) / "agentrl.json"
            if (Path(model_dir) / "adapter_config.json").is_file():  # a LoRA adapter (e.g. passed through unchanged):
                old = json.loads(card_path.read_text()) if card_path.is_file() else {}  # its base stays named
                card.kind = "lora"
                base = (old.get("extra") or {}).get("base_uri")
                if base and not card.extra.get("base_uri"):
                    card.extra = {**card.extra, "base_uri": base}
            card_path.write_text(json.dumps(to_record(card), indent=1))
        uri = self.storage_uri(root, "model")
        storage.put_dir(model_dir, uri)
        self.log_artifact(Path(model_dir) / "agentrl.json")
        self.set_tags({"agentrl.model_uri": uri})
        return uri

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for k, v in scrub(tags).items():
            self._call({"op": "tag", "run_id": self.run_id, "key": k, "value": str(v)})

    # -- registry ------------------------------------------------------------------------------
    def register_model(self, artifact_path: str, alias: str | None = None, tags: Mapping[str, str] | None = None):
        """Register the model logged at `artifact_path` of this run; returns the ModelVersion."""
        return Registry(self.tracking_uri, self.registered_model).register(
            source=self.artifact_uri(artifact_path), run_id=self.run_id, alias=alias, tags=tags
        )


def flush_pending(root: str | os.PathLike, tracking_uri: str | None = None, exclude: set[str] = frozenset(),
                  quiet: bool = False) -> dict[str, dict[str, tuple[int, int]]]:
    """Send what runs left buffered under `root` (a phase that ended while the server was down). Each goes to
    the server its run used (or `tracking_uri`). Returns run id -> {"sent": (metrics, calls), "left": (...)}."""
    from mlflow import MlflowClient

    out: dict[str, dict[str, tuple[int, int]]] = {}
    root = Path(root)
    for meta in sorted(root.glob("*.meta.json")) if root.exists() else []:
        try:
            info = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):  # removed or half-written by its owner meanwhile
            continue
        if info["run_id"] in exclude or Outbox.owned_elsewhere(info):
            continue
        box = Outbox(root, info["run_id"], tracking_uri or info["tracking_uri"])
        before = box.pending()
        try:
            box.send(MlflowClient(tracking_uri=box.tracking_uri))
        except Exception as exc:
            if not _is_unreachable(exc):
                raise
        after = box.pending()
        out[info["run_id"]] = {"sent": (before[0] - after[0], before[1] - after[1]), "left": after}
        if not quiet and before != (0, 0):
            log.warning("run %s: sent %d buffered metrics and %d calls; %d and %d left", info["run_id"],
                        before[0] - after[0], before[1] - after[1], *after)
    return out


def ensure_experiment(client, name: str, tracking_uri: str) -> str:
    """The id of experiment `name`, created if needed (local stores keep artifacts beside mlflow.db)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:"):
        home = Path(tracking_uri.split("///", 1)[-1]).parent
        artifact_location = (home / "artifacts").resolve().as_uri()
    try:
        # MLflow 3's UI opens a model-training experiment on its runs (not the GenAI traces view)
        return client.create_experiment(name, artifact_location=artifact_location,
                                        tags={"mlflow.experimentKind": "custom_model_development"})
    except Exception:
        exp = client.get_experiment_by_name(name)  # created by a sibling task meanwhile
        if exp is None:
            raise
        return exp.experiment_id


def finish_pipeline_runs(tracking_uri: str, experiment: str, kfp_run_id: str, state: str,
                         parent_run_id: str = "", error: str = "") -> list[str]:
    """The pipeline's exit step: end its parent MLflow run(s) — the one tagged with this KFP run, and `parent_run_id`
    when the run was given one — FINISHED when KFP says SUCCEEDED, else FAILED. Returns the ids ended."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    ids = [parent_run_id] if parent_run_id else []
    exp = client.get_experiment_by_name(experiment)
    if exp is not None and kfp_run_id:
        flt = f"tags.`kfp.run_id` = '{kfp_run_id}' and tags.`agentrl.kind` = 'pipeline'"
        ids += [r.info.run_id for r in client.search_runs([exp.experiment_id], flt) if r.info.run_id not in ids]
    status = "FINISHED" if state == "SUCCEEDED" else "FAILED"
    for run_id in ids:
        client.set_tag(run_id, "kfp.final_state", state)
        if error:
            client.set_tag(run_id, "kfp.error", error[:4000])
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status=status)
    return ids


def start_pipeline_run(tracking_uri: str, experiment: str, run_name: str, tags: Mapping[str, str] | None = None) -> str:
    """Create the parent run of one pipeline run; phases nest under it. Returns its id."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    exp_id = ensure_experiment(client, experiment, tracking_uri)
    return client.create_run(exp_id, run_name=run_name, tags={"agentrl.kind": "pipeline", **(tags or {})}).info.run_id


def end_run(tracking_uri: str, run_id: str, status: str = "FINISHED") -> None:
    from mlflow import MlflowClient

    MlflowClient(tracking_uri).set_terminated(run_id, status=status)


class NullRun:
    """What ranks other than 0 of a distributed job get instead of a PhaseRun: tracking is rank 0's job."""

    def __init__(self, phase: str, parent_run_id: str | None = None) -> None:
        self.phase = phase
        self.run_id = os.environ.get("AGENTRL_RUN_ID", f"rank{os.environ.get('RANK', '0')}")
        self.parent_run_id = parent_run_id

    def __enter__(self) -> NullRun:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def log_metrics(self, *a, **k) -> None:
        return None

    log_new_metrics = log_metrics

    def log_artifact(self, *a, **k) -> None:
        return None

    def set_tags(self, *a, **k) -> None:
        return None


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def phase_run(phase: str, **kwargs: Any) -> PhaseRun | NullRun:
    """A PhaseRun on rank 0 (or a single process), a NullRun on the other ranks of a torchrun job."""
    if rank() != 0:
        return NullRun(phase, kwargs.get("parent_run_id"))
    return PhaseRun(phase, **kwargs)


class Registry:
    """The model registry: `agentrl-policy` with aliases `champion` and `challenger`."""

    def __init__(self, tracking_uri: str | None = None, name: str = "agentrl-policy") -> None:
        from mlflow import MlflowClient

        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.name = name
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def ensure(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            try:
                self.client.create_registered_model(self.name)
            except MlflowException:
                self.client.get_registered_model(self.name)  # created concurrently

    def register(self, source: str, run_id: str | None = None, alias: str | None = None, tags=None, timeout_s=60):
        self.ensure()
        mv = self.client.create_model_version(self.name, source=source, run_id=run_id, tags=dict(tags or {}))
        deadline = time.time() + timeout_s
        while mv.status != "READY" and time.time() < deadline:
            time.sleep(0.2)
            mv = self.client.get_model_version(self.name, mv.version)
        if mv.status != "READY":
            raise RuntimeError(f"model version {self.name}/{mv.version} not READY: {mv.status}")
        if alias:
            self.set_alias(alias, mv.version)
        return mv

    def set_alias(self, alias: str, version: str | int) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def download(self, alias: str, dest: str | os.PathLike) -> tuple[str, str] | None:
        """(local Hugging Face directory, version) of the model version behind `alias`, downloaded into `dest`; None
        when the registry has no such alias (e.g. no champion before the first promotion)."""
        import mlflow

        from components.core.policy import from_mlflow_model

        mv = self.get_alias(alias)
        if mv is None:
            return None
        local = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dest),
                                                    tracking_uri=self.tracking_uri)
        return str(from_mlflow_model(local)), str(mv.version)  # the flavour's weights and tokenizer as one directory

    def get_alias(self, alias: str):
        """The ModelVersion behind `alias`, or None."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(self.name, alias)
        except MlflowException:
            return None
