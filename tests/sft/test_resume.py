"""SFT resumes on a retry: SIGKILL twice at random checkpoints, restart each time; the run ends at the same
step with the same weights as an uninterrupted one, and MLflow holds one run with every step logged once.
(The same `TrainerCheckpoints` serve rejection sampling's SFT and DPO; their tests retry a finished run.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from safetensors.torch import load_file

from components.core.checkpoint import HF_STATE, Checkpoints
from components.core.config import load_config
from components.core.tracking import local_tracking_uri, start_pipeline_run
from tests.helpers.runtime import kill_after_checkpoint, sft_inputs

pytestmark = pytest.mark.slow
STEPS, EVERY = 16, 2


def _overrides(home: Path) -> dict:
    return {"run": {"home": str(home), "torch_threads": 1},
            "sft": {"max_steps": STEPS, "batch_size": 4, "max_minutes": None, "eval_suites": [], "logging_steps": 1,
                    "checkpoint_every": EVERY, "torch_threads": 1, "learning_rate": 1e-3},
            "model": {"tiny": {"hidden_size": 192, "num_layers": 4, "intermediate_size": 384, "pretrain_steps": 0}}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft-resume")
    return sft_inputs(d, load_config(overrides_json=json.dumps(_overrides(d / "unused"))))


def _start(tmp_path: Path, name: str, inputs) -> tuple[subprocess.Popen, dict]:
    home = tmp_path / name / "home"
    home.mkdir(parents=True, exist_ok=True)
    parent_file = home / "parent"
    if not parent_file.exists():  # one pipeline run: every attempt of the step has the same parent run
        parent_file.write_text(start_pipeline_run(local_tracking_uri(home), "agentrl", name))
    args = {"overrides": json.dumps(_overrides(home)), "base_model": str(inputs[1]), "demos": str(inputs[0]),
            "parent_run_id": parent_file.read_text(), "model_out": str(tmp_path / name / "out"),
            "work_dir": str(tmp_path / name / "work")}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = (tmp_path / f"{name}.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "components.sft", "--args", json.dumps(args),
                             "--result", str(tmp_path / name / "result.json")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, args


def _ckpts(args: dict) -> Checkpoints:
    home = Path(json.loads(args["overrides"])["run"]["home"])
    return Checkpoints(str(home / "store" / "checkpoints" / args["parent_run_id"] / "sft"), staging=home / "probe",
                       state_name=HF_STATE)


def _latest(args: dict) -> int:
    root = Path(_ckpts(args).root)
    done = _ckpts(args).complete() if root.exists() else []
    return done[-1][0] if done else 0


def test_sigkill_twice_then_resume_exactly(tmp_path, inputs):
    proc, straight = _start(tmp_path, "straight", inputs)
    assert proc.wait(timeout=600) == 0, (tmp_path / "straight.log").read_text()[-3000:]

    rng = random.Random(11)
    kill_after = sorted(rng.sample(range(EVERY, STEPS - EVERY, EVERY), 2))
    for k in kill_after:
        proc, killed = _start(tmp_path, "killed", inputs)
        kill_after_checkpoint(proc, lambda args=killed: _latest(args), k, tmp_path / "killed.log", rng.uniform(0.0, 0.1))
    before_last = _latest(killed)
    proc, killed = _start(tmp_path, "killed", inputs)
    assert proc.wait(timeout=600) == 0, (tmp_path / "killed.log").read_text()[-3000:]

    res = json.loads((tmp_path / "killed" / "result.json").read_text())
    assert res["metrics"]["train_steps"] == STEPS
    assert res["metrics"]["resumed_from"] == before_last >= kill_after[-1]
    a = load_file(str(Path(straight["model_out"]) / "model.safetensors"))
    b = load_file(str(Path(killed["model_out"]) / "model.safetensors"))
    assert a.keys() == b.keys()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff

    # one MLflow run for the three attempts; every step of the loss logged exactly once
    client = MlflowClient(local_tracking_uri(tmp_path / "killed" / "home"))
    runs = client.search_runs(client.get_experiment_by_name("agentrl").experiment_id, "tags.`agentrl.phase` = 'sft'")
    assert len(runs) == 1
    assert runs[0].data.tags["agentrl.sft.resumed_from"] == str(before_last)
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "sft/loss")]
    assert sorted(steps) == list(range(1, STEPS + 1)), steps
    # the budget's clock carried over: the state holds the seconds trained across attempts
    last = json.loads((Path(_ckpts(killed).latest()[1]) / HF_STATE).read_text())
    assert last["train_seconds"] > 0 and last["finished"] is True and _ckpts(killed).latest()[0] == STEPS

    # a retry after training finished (the pod died during the evaluation) trains nothing more
    proc, again = _start(tmp_path, "killed", inputs)
    assert proc.wait(timeout=600) == 0, (tmp_path / "killed.log").read_text()[-3000:]
    res = json.loads((tmp_path / "killed" / "result.json").read_text())
    assert res["metrics"]["train_steps"] == STEPS and res["metrics"]["resumed_from"] == STEPS
    c = load_file(str(Path(again["model_out"]) / "model.safetensors"))
    assert max(float((a[k] - c[k]).abs().max()) for k in a) <= 1e-6
