"""The sandbox_build phase: files, metrics, report, MLflow, determinism."""

from __future__ import annotations

import base64
import json

import pytest
from mlflow import MlflowClient

from components.core.schema import Task, Trajectory, read_jsonl
from components.sandbox import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    overrides = json.dumps({"run": {"home": str(home)}})
    a = run(overrides=overrides, out_dir=str(home / "a"))
    b = run(overrides=overrides, out_dir=str(home / "b"))
    c = run(overrides=json.dumps({"run": {"home": str(home)}, "sandbox": {"seed": 5}}), out_dir=str(home / "c"))
    return home, a, b, c


def test_outputs_and_determinism(built):
    home, a, b, c = built
    da, db, dc = (json.loads((__import__("pathlib").Path(r.out_dir) / "digests.json").read_text()) for r in (a, b, c))
    assert da == db and da["world"] != dc["world"] and da["tasks"] != dc["tasks"]
    from pathlib import Path

    out = Path(a.out_dir)
    assert (out / "world.json").read_bytes() == (Path(b.out_dir) / "world.json").read_bytes()
    for s in ("train", "easy", "hard", "safety", "robustness"):
        assert len(list(read_jsonl(out / "tasks" / f"{s}.jsonl", Task))) == a.metrics[f"tasks_{s}"]
    demos = list(read_jsonl(out / "demos" / "train.jsonl", Trajectory))
    assert len(demos) == a.metrics["tasks_train"] and all(d.verdict.success for d in demos)
    assert (out / "corpus.txt").stat().st_size > 10_000


def test_metrics_say_solvable_and_unhackable(built):
    _, a, _, _ = built
    for s in ("train", "easy", "hard", "safety", "robustness"):
        assert a.metrics[f"expert_success_{s}_json"] == 1.0 and a.metrics[f"expert_success_{s}_code"] == 1.0
    assert all(a.metrics[f"probe_pass_{p}"] == 0.0 for p in ("do_nothing", "say_done", "wrong_items", "empty_artifact"))


def test_report_has_embedded_plots(built):
    from pathlib import Path

    _, a, _, _ = built
    html = (Path(a.out_dir) / "report.html").read_text()
    imgs = html.split('src="data:image/png;base64,')[1:]
    assert len(imgs) >= 4
    for img in imgs:
        assert base64.b64decode(img.split('"', 1)[0])[:8] == b"\x89PNG\r\n\x1a\n"


def test_logged_to_mlflow_and_stored(built):
    from components.core import storage

    home, a, _, _ = built
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    r = client.get_run(a.run_id)
    assert r.data.tags["agentrl.phase"] == "sandbox_build"
    assert r.data.metrics["sandbox_build/expert_success_hard_code"] == 1.0
    names = {f.path for f in client.list_artifacts(a.run_id)}
    assert {"report.html", "metrics.json", "digests.json"} <= names
    assert storage.is_complete(a.uri)


def test_bad_override_fails_before_work(tmp_path):
    from components.core.config import ConfigError

    with pytest.raises(ConfigError, match="sandbox.num_users = 0"):
        run(overrides=json.dumps({"run": {"home": str(tmp_path)}, "sandbox": {"num_users": 0}}))
    assert not (tmp_path / "mlflow.db").exists()
