"""Exact resume, synchronous and asynchronous: SIGKILL at random steps, restart each time; the run ends at the same step with the
same weights as an uninterrupted one, and MLflow holds every step exactly once."""

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

from components.core.checkpoint import Checkpoints
from tests.helpers.runtime import kill_after_checkpoint

pytestmark = pytest.mark.slow
STEPS = 6


def _args(tmp_path: Path, name: str, model: Path, staleness: int = 0) -> dict:
    ov = {"run": {"home": str(tmp_path / name / "home"), "torch_threads": 1},
          "sandbox": {"max_turns": 2, "suite_sizes": {"easy": 2}},
          "generation": {"max_new_tokens": 16},
          "grpo": {"steps": STEPS, "tasks_per_step": 2, "group_size": 2, "micro_batch_size": 2, "eval_every": 0, "output": "last",
                   "group_filter": "none",  # an untrained model fails every task: the filter would leave no gradient
                   "eval_suites": ["easy"], "checkpoint_every": 1, "learning_rate": 1e-3, "torch_threads": 1,
                   "repair": {"every_k_steps": 3, "sft_steps": 1, "on_alarm": False},
                   "async": {"max_staleness": staleness}}}
    return {"overrides": json.dumps(ov), "policy_model": str(model), "model_out": str(tmp_path / name / "out"),
            "checkpoint_uri": str(tmp_path / name / "ckpt"), "parent_run_id": None}


def _start(args: dict, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "components.grpo", "--args", json.dumps(args)], env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _latest(ckpt: Path) -> int:
    done = Checkpoints(str(ckpt), staging=ckpt.parent / "probe").complete() if ckpt.exists() else []
    return done[-1][0] if done else 0


@pytest.mark.parametrize("staleness,kills", [(0, 3), (1, 2)], ids=["sync", "async"])
def test_sigkill_at_random_steps_then_resume_exactly(tmp_path, tiny_model_dir, staleness, kills):
    """async: a checkpoint also holds the batch already sampled for the next step (by the previous version)."""
    straight = _args(tmp_path, "straight", tiny_model_dir, staleness)
    assert _start(straight, tmp_path / "straight.log").wait(timeout=900) == 0

    killed = _args(tmp_path, "killed", tiny_model_dir, staleness)
    ckpt = Path(killed["checkpoint_uri"])
    rng = random.Random(7)
    kill_after = sorted(rng.sample(range(1, STEPS - 1), kills))  # checkpoints after which a kill lands mid-step
    log = tmp_path / "killed.log"
    for k in kill_after:
        kill_after_checkpoint(_start(killed, log), lambda: _latest(ckpt), k, log, rng.uniform(0.0, 0.4))
    assert _start(killed, log).wait(timeout=900) == 0, log.read_text()[-3000:]

    # same step count, same weights
    assert _latest(ckpt) == STEPS
    a = load_file(str(Path(straight["model_out"]) / "model.safetensors"))
    b = load_file(str(Path(killed["model_out"]) / "model.safetensors"))
    assert a.keys() == b.keys()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff
    # one MLflow run, every step exactly once
    client = MlflowClient(f"sqlite:///{tmp_path}/killed/home/mlflow.db")
    runs = client.search_runs(client.get_experiment_by_name("agentrl").experiment_id,
                              "tags.`agentrl.phase` = 'grpo'")
    assert len(runs) == 1
    for key in ("grpo/reward_mean", "grpo/loss", "grpo/monitor/entropy"):
        assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, key)) == list(range(1, STEPS + 1))
    assert int(runs[0].data.tags["agentrl.grpo.resumed_from"]) >= kill_after[-1]  # the last start resumed
