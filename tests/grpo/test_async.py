"""Asynchronous GRPO on the tiny model, real sampling: batch k is sampled by the policy of step k - s on a rollout
thread, the lag is exactly s whatever the timing (two runs end with the same weights), and the loss sees it."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient
from safetensors.torch import load_file

from components.grpo import recipe

pytestmark = pytest.mark.slow


def _run(tmp_path, name, model, **grpo):
    ov = {"run": {"home": str(tmp_path / name / "home"), "torch_threads": 1},
          "sandbox": {"max_turns": 2, "suite_sizes": {"easy": 2}},
          "generation": {"max_new_tokens": 16},
          "grpo": {"steps": 4, "tasks_per_step": 2, "group_size": 2, "micro_batch_size": 2, "eval_every": 0,
                   "output": "last", "group_filter": "none", "eval_suites": ["easy"], "eval_max_tasks": 2,
                   "checkpoint_every": 2, "learning_rate": 1e-3, "torch_threads": 1, "max_minutes": None,
                   "checkpoint_uri": str(tmp_path / name / "ckpt"),
                   # an untrained model fails every task alike (no advantage): a repair SFT step moves the weights
                   # every step, so that each version differs from the one before
                   "repair": {"every_k_steps": 1, "sft_steps": 1, "on_alarm": False}, **grpo}}
    res = recipe.run(overrides=json.dumps(ov), policy_model=str(model), model_out=str(tmp_path / name / "out"),
                     work_dir=str(tmp_path / "work"))
    client = MlflowClient(f"sqlite:///{tmp_path}/{name}/home/mlflow.db")
    hist = {k: [m.value for m in sorted(client.get_metric_history(res.run_id, f"grpo/{k}"), key=lambda m: m.step)]
            for k in ("offpolicy/staleness", "offpolicy/logprob_gap", "offpolicy/is_weight_mean",
                      "offpolicy/is_truncated_fraction")}
    return res, hist, load_file(str(tmp_path / name / "out" / "model.safetensors"))


def test_async_lags_by_exactly_s_and_is_deterministic(tmp_path, tiny_model_dir, monkeypatch):
    res, hist, w1 = _run(tmp_path, "a", tiny_model_dir, **{"async": {"max_staleness": 1}})
    assert res.steps_done == 4
    assert hist["offpolicy/staleness"] == [0.0, 1.0, 1.0, 1.0]
    # step 0 is sampled by the learner's own weights; later steps by the previous version, which differs from the
    # learner once a step has moved the weights (the repair after step 1 at the latest)
    gap = hist["offpolicy/logprob_gap"]
    assert gap[0] < 1e-4 and min(gap[2:]) > 1e-3, gap
    assert len(hist["offpolicy/is_weight_mean"]) == 4 and hist["offpolicy/is_weight_mean"][0] == pytest.approx(1.0)
    # the same run again: the same weights, whatever the threads' timing
    _, _, w2 = _run(tmp_path, "b", tiny_model_dir, **{"async": {"max_staleness": 1}})
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) == 0.0
    # and the synchronous run differs (it samples step k with version k)
    _, sync, w0 = _run(tmp_path, "sync", tiny_model_dir)
    assert sync["offpolicy/staleness"] == [0.0] * 4 and max(sync["offpolicy/logprob_gap"]) < 1e-4
    assert sync["offpolicy/is_weight_mean"] == []  # 'auto': no correction when the sampler is the learner
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w1) > 0.0
