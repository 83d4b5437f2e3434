"""Benchmarks of the foundation: each pits our layer against the bare library, side by side."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from components.core import storage
from components.core.schema import Task, Verifier, read_jsonl, write_jsonl


def timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_tiny_build(out: dict) -> None:
    """Cold: a fresh process pinned to one core (imports included), as a user's first `make run` sees it."""
    import shutil
    import subprocess
    import sys

    code = (
        "from components.core.tiny import build_tiny_model, set_torch_threads; set_torch_threads(1);"
        "from components.core.config import TinyModelConfig;"
        "import sys; build_tiny_model(sys.argv[1], TinyModelConfig(pretrain_steps=0), seed=0)"
    )
    with tempfile.TemporaryDirectory() as d:
        pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
        t0 = time.perf_counter()
        subprocess.run([*pin, sys.executable, "-c", code, str(Path(d) / "m")], check=True, capture_output=True)
        cold = time.perf_counter() - t0
    out["tiny.build_cold_s"] = {"value": round(cold, 2), "unit": "s", "goal": 30.0, "baseline": None, "ratio": None}


def bench_storage(out: dict, s3_endpoint: str, bucket: str) -> None:
    import boto3

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        src.mkdir()
        for i in range(20):
            (src / f"shard-{i}.bin").write_bytes(bytes([i]) * 1_000_000)
        mb = 20.0
        client = boto3.client("s3", endpoint_url=s3_endpoint)

        def raw():
            for p in sorted(src.iterdir()):
                client.upload_file(str(p), bucket, f"raw/{p.name}")

        ours_t = timed(lambda: storage.put_dir(src, f"s3://{bucket}/ours"))
        raw_t = timed(raw)
        out["storage.s3_put_dir_MBps"] = {
            "value": round(mb / ours_t, 1), "unit": "MB/s", "goal": None,
            "baseline": round(mb / raw_t, 1), "ratio": round(raw_t / ours_t, 3),
        }
        get_t = timed(lambda: storage.get_dir(f"s3://{bucket}/ours", Path(d) / "dl"))
        raw_get = timed(lambda: [client.download_file(bucket, f"raw/{p.name}", str(Path(d) / p.name))
                                 for p in sorted(src.iterdir())])
        out["storage.s3_get_dir_MBps"] = {
            "value": round(mb / get_t, 1), "unit": "MB/s", "goal": None,
            "baseline": round(mb / raw_get, 1), "ratio": round(raw_get / get_t, 3),
        }


def bench_tracking(out: dict, tracking_uri: str) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from components.core.tracking import PhaseRun

    n = 200
    with tempfile.TemporaryDirectory() as d:
        run = PhaseRun("bench", tracking_uri=tracking_uri, experiment="bench", buffer_dir=d).start()
        client = MlflowClient(tracking_uri)

        def ours():
            for i in range(n):
                run.log_metrics({"loss": 1.0 / (i + 1)}, step=i)

        def raw():
            for i in range(n):
                client.log_batch(run.run_id, metrics=[Metric("bench/raw", 1.0 / (i + 1), int(time.time() * 1000), i)])

        ours_t, raw_t = timed(ours, 1), timed(raw, 1)
        run.end()
    out["tracking.log_metrics_per_s"] = {
        "value": round(n / ours_t, 1), "unit": "calls/s", "goal": None,
        "baseline": round(n / raw_t, 1), "ratio": round(raw_t / ours_t, 3),
    }
    # the server down (nothing listens on the port), production retry settings: a log call must not wait on it
    from tests.helpers.servers import HOST, free_port

    dead = f"http://{HOST}:{free_port()}"
    with tempfile.TemporaryDirectory() as d:
        run = PhaseRun("bench", tracking_uri=dead, experiment="bench", buffer_dir=d)
        run.run_id, run.parent_run_id = "deadbeef", "deadbeef"  # no server to create a run on
        from components.core.tracking import Outbox, _Sender

        run._outbox = Outbox(Path(d), run.run_id, dead).open()
        run._sender = _Sender(run, run._outbox)
        run._sender.leftovers = False
        run._sender.start()
        ours_t = timed(ours, 1)
        pending = run.pending()[0]
        run.flush_timeout_s = 0.0
        run.end()
        client = MlflowClient(dead)

        def raw_down():
            for i in range(2):
                try:
                    client.log_batch("deadbeef", metrics=[Metric("bench/raw", 1.0, int(time.time() * 1000), i)])
                except Exception:  # noqa: BLE001 - the point: how long it waits before it fails
                    pass

        raw_t = timed(raw_down, 1) / 2 * n
    out["tracking.log_metrics_per_s_server_down"] = {
        "value": round(n / ours_t, 1), "unit": "calls/s", "goal": None, "baseline": round(n / raw_t, 3),
        "ratio": round(raw_t / ours_t, 1), "buffered": pending,
    }


def bench_schema(out: dict) -> None:
    n = 20_000
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.jsonl"
        write_jsonl(path, (Task(f"t{i}", "s0", 1 + i % 5, "train", "Move the mails", "u0",
                                Verifier("folder", {"ids": [i]})) for i in range(n)))
        ours_t = timed(lambda: sum(1 for _ in read_jsonl(path, Task)), 1)
        raw_t = timed(lambda: sum(1 for line in open(path) if json.loads(line)), 1)
    out["schema.read_records_per_s"] = {
        "value": round(n / ours_t), "unit": "records/s", "goal": None,
        "baseline": round(n / raw_t), "ratio": round(raw_t / ours_t, 3),
    }
