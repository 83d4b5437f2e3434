"""The SFT phase over two processes with torchrun (gloo on CPU): the path a multi-GPU pod takes."""

from __future__ import annotations

import json

import pytest

from components.core.config import load_config
from components.core.policy import load_policy
from components.core.schema import write_jsonl
from components.core.tiny import build_tiny_model
from components.sandbox import expert
from components.sandbox.build import corpus_lines
from components.sandbox.env import WorkspaceEnv
from components.sandbox.tasks import generate_tasks
from components.sandbox.world import generate_world
from components.sft.trainer import run_distributed

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("deepspeed", [None, "zero3"])
def test_sft_over_two_processes_with_torchrun(tmp_path, monkeypatch, deepspeed):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU (gloo); a GPU pod uses cuda/nccl
    home = tmp_path / "home"
    overrides = {"run": {"home": str(home)}, "sft": {"epochs": 1, "batch_size": 2, "max_minutes": None, "deepspeed": deepspeed,
                                                     "eval_suites": [], "logging_steps": 1},
                 "model": {"tiny": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128}}}
    cfg = load_config(overrides_json=json.dumps(overrides))
    world = generate_world(cfg.sandbox)
    tasks = generate_tasks(world, cfg.sandbox)["train"][:16]
    env = WorkspaceEnv(world, cfg.sandbox)
    demos = [expert.solve_json(env, t)[0] for t in tasks]
    write_jsonl(tmp_path / "demos" / "train.jsonl", demos)
    base = build_tiny_model(tmp_path / "base", cfg.model.tiny, corpus_lines(world, demos), seed=0)
    res = run_distributed(2, overrides=json.dumps(overrides), base_model=str(base), demos=str(tmp_path / "demos"),
                          model_out=str(tmp_path / "out"))
    assert res.metrics["world_size"] == 2.0
    assert res.metrics["deepspeed"] == float(deepspeed is not None)
    assert res.metrics["train_steps"] == 4  # 16 examples / (2 per device x 2 processes)
    pol = load_policy(str(tmp_path / "out"))
    assert pol.card is not None and pol.card.phase == "sft"
    from mlflow import MlflowClient

    runs = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").search_runs(
        [MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_experiment_by_name("agentrl").experiment_id],
        filter_string="tags.`agentrl.phase` = 'sft'")
    assert len(runs) == 1  # only rank 0 tracked
