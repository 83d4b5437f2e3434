"""tracking against a real `mlflow server` on 127.0.0.1 (sqlite backend, artifacts in moto's S3)."""

from __future__ import annotations

import threading
import time
import warnings

import boto3
import pytest
from mlflow import MlflowClient

from components.core.config import load_config
from components.core.tracking import PhaseRun, Registry, scrub
from tests.helpers.servers import FaultProxy

pytestmark = pytest.mark.slow


@pytest.fixture
def fast_fail(monkeypatch):
    # a dead server should be noticed at once in tests (production keeps a couple of retries)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_nested_runs_metric_keys_artifacts_and_alias(mlflow_server, bucket, tmp_path, fast_fail):
    cfg = load_config(set_pairs=[f"run.home={tmp_path / 'home'}"])
    with PhaseRun("sft", config=cfg, tracking_uri=mlflow_server.url, experiment="exp") as sft:
        sft.log_metrics({"loss": 2.0, "lr": 1e-3}, step=1)
        sft.log_metrics({"loss": 1.5}, step=2)
        model = tmp_path / "model"
        model.mkdir()
        (model / "weights.bin").write_bytes(b"w" * 100)
        sft.log_artifact(model, "model")
        mv = sft.register_model("model", alias="champion")
    with PhaseRun("grpo", config=cfg, parent_run_id=sft.parent_run_id, tracking_uri=mlflow_server.url,
                  experiment="exp") as grpo:
        grpo.log_metrics({"reward_mean": 0.5}, step=1)

    client = MlflowClient(mlflow_server.url)
    parent = client.get_run(sft.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert client.get_experiment_by_name("exp").tags["mlflow.experimentKind"] == "custom_model_development"
    for run in (sft, grpo):
        r = client.get_run(run.run_id)
        assert r.data.tags["mlflow.parentRunId"] == sft.parent_run_id
        assert r.info.status == "FINISHED"
    assert set(client.get_run(sft.run_id).data.metrics) == {"sft/loss", "sft/lr"}
    assert history(client, sft.run_id, "sft/loss") == [(1, 2.0), (2, 1.5)]
    assert set(client.get_run(grpo.run_id).data.metrics) == {"grpo/reward_mean"}
    # resolved config as flattened params
    params = client.get_run(sft.run_id).data.params
    assert params["grpo.group_size"] == "4" and params["model.base_uri"] == "tiny"
    # the artifact is in the bucket behind the server
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert any(k.endswith("model/weights.bin") and sft.run_id in k for k in keys), keys
    # the alias points at the registered version
    champ = Registry(mlflow_server.url).get_alias("champion")
    assert champ is not None and champ.version == mv.version and champ.run_id == sft.run_id


def until(cond, what: str, tries: int = 600) -> None:
    """Wait for the background sender to reach a state (bounded by tries, not by a timing assertion)."""
    for _ in range(tries):
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def test_server_down_mid_run_loses_and_duplicates_nothing(mlflow_server, tmp_path, fast_fail):
    cfg = load_config(set_pairs=[f"run.home={tmp_path / 'home'}"])
    run = PhaseRun("grpo", config=cfg, tracking_uri=mlflow_server.url, experiment="outage").start()
    for step in range(5):
        run.log_metrics({"loss": 10.0 - step, "reward": step / 10}, step=step)
    run.flush()
    mlflow_server.stop()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(5, 10):
            run.log_metrics({"loss": 10.0 - step, "reward": step / 10}, step=step)  # must not raise
        until(lambda: run._sender.down, "the sender notices the outage")
    assert run.pending()[0] == 10
    mlflow_server.start()
    for step in range(10, 15):
        run.log_metrics({"loss": 10.0 - step, "reward": step / 10}, step=step)
    run.end()
    assert run.left_buffered == (0, 0)
    client = MlflowClient(mlflow_server.url)
    for key, fn in (("grpo/loss", lambda s: 10.0 - s), ("grpo/reward", lambda s: s / 10)):
        assert history(client, run.run_id, key) == [(s, fn(s)) for s in range(15)]
    assert client.get_run(run.run_id).info.status == "FINISHED"
    assert list(run.buffer_root.iterdir()) == []


def test_answer_lost_after_server_stored_the_batch_is_not_duplicated(mlflow_server, tmp_path, fast_fail):
    proxy = FaultProxy(mlflow_server.url).start()
    try:
        cfg = load_config(set_pairs=[f"run.home={tmp_path / 'home'}"])
        run = PhaseRun("dpo", config=cfg, tracking_uri=proxy.url, experiment="lost").start()
        run.log_metrics({"loss": 1.0}, step=0)
        run.flush()
        proxy.drop_responses = 1  # the next batch reaches the server, its answer is lost
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.log_metrics({"loss": 0.5}, step=1)
            until(lambda: proxy.dropped == 1 and not run._sender.in_flight, "the answer is dropped")
        run.log_metrics({"loss": 0.25}, step=2)
        run.end()
        client = MlflowClient(mlflow_server.url)
        assert history(client, run.run_id, "dpo/loss") == [(0, 1.0), (1, 0.5), (2, 0.25)]
    finally:
        proxy.stop()


def test_logging_never_waits_on_a_hung_server(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")  # the hung request would wait this long
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    proxy = FaultProxy(mlflow_server.url).start()
    try:
        cfg = load_config(set_pairs=[f"run.home={tmp_path / 'home'}"])
        run = PhaseRun("grpo", config=cfg, tracking_uri=proxy.url, experiment="hung").start()
        run.flush()
        proxy.hold = threading.Event()  # from now on the server takes requests and answers none
        run.log_metrics({"loss": 0.0}, step=0)
        until(lambda: proxy.held >= 1, "the sender's request hangs")
        for step in range(1, 200):
            run.log_metrics({"loss": float(step)}, step=step)  # each returns although the sender is stuck
        assert run._sender.in_flight and run._sender.attempts == 1 and run.pending()[0] == 200
        proxy.hold.set()  # the server answers again
        run.end()
        client = MlflowClient(mlflow_server.url)
        assert history(client, run.run_id, "grpo/loss") == [(s, float(s)) for s in range(200)]
    finally:
        proxy.hold.set()
        proxy.stop()


def test_a_tail_buffered_at_the_end_is_sent_by_the_next_phase_or_agentrl_flush(mlflow_server, tmp_path, fast_fail,
                                                                               capsys):
    from pipelines.cli import main

    home = tmp_path / "home"
    cfg = load_config(set_pairs=[f"run.home={home}", "tracking.flush_timeout_s=1.0"])
    client = MlflowClient(mlflow_server.url)
    art = tmp_path / "report.md"
    art.write_text("# report")
    for flusher in ("next phase", "agentrl flush"):
        run = PhaseRun("eval", config=cfg, tracking_uri=mlflow_server.url, experiment="tail").start()
        run.log_metrics({"acc": 0.5}, step=0)
        run.flush()
        mlflow_server.stop()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.log_metrics({"acc": 0.75}, step=1)
            run.set_tags({"agentrl.note": "tail"})
            run.log_artifact(art, "report")
            run.end()
        n, ops = run.left_buffered
        assert n == 1 and ops == 4  # the metric; the tag, the artifact and both runs' final statuses
        assert "still buffered" in capsys.readouterr().err
        mlflow_server.start()
        assert client.get_run(run.run_id).info.status == "RUNNING"
        if flusher == "next phase":
            with PhaseRun("gate", config=cfg, tracking_uri=mlflow_server.url, experiment="tail") as nxt:
                nxt.log_metrics({"x": 1.0}, step=0)
        else:
            assert main(["flush", "--home", str(home), "--tracking-uri", mlflow_server.url]) == 0
        got = client.get_run(run.run_id)
        assert history(client, run.run_id, "eval/acc") == [(0, 0.5), (1, 0.75)], flusher
        assert got.info.status == "FINISHED" and got.data.tags["agentrl.note"] == "tail"
        assert client.get_run(run.parent_run_id).info.status == "FINISHED"
        assert [a.path for a in client.list_artifacts(run.run_id, "report")] == ["report/report.md"]
        assert not [p for p in (home / "metric_buffer").iterdir() if run.run_id in p.name], flusher


def test_kfp_injected_run_is_used(mlflow_server, tmp_path, fast_fail, monkeypatch):
    client = MlflowClient(mlflow_server.url)
    exp = client.create_experiment("kfp-plugin")
    parent = client.create_run(exp, run_name="pipeline-run")
    task = client.create_run(exp, run_name="sft-task", tags={"mlflow.parentRunId": parent.info.run_id})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("MLFLOW_RUN_ID", task.info.run_id)
    with PhaseRun("sft", config=load_config(set_pairs=[f"run.home={tmp_path}"])) as run:
        run.log_metrics({"loss": 3.0}, step=1)
    assert run.run_id == task.info.run_id
    assert run.parent_run_id == parent.info.run_id
    assert history(client, task.info.run_id, "sft/loss") == [(1, 3.0)]
    assert len(client.search_runs([exp])) == 2  # nothing extra created


def test_secrets_never_reach_params():
    out = scrub({
        "storage.aws_secret_access_key": "abc",
        "tracking.password": "pw",
        "tracking.api_key": "k",
        "tracking.tracking_uri": "https://user:hunter2@mlflow.example.com",
        "generation.max_new_tokens": 96,
        "model.tiny.num_kv_heads": 2,
    })
    assert out["storage.aws_secret_access_key"] == "***"
    assert out["tracking.password"] == "***" and out["tracking.api_key"] == "***"
    assert "hunter2" not in out["tracking.tracking_uri"]
    assert out["generation.max_new_tokens"] == 96 and out["model.tiny.num_kv_heads"] == 2
