"""The DPO phase end to end on the embedded default: simulated A/B logs -> pairs -> DPO -> safety check."""

from __future__ import annotations

import json
import math

import pytest
from mlflow import MlflowClient

from components.core.config import load_config
from components.core.schema import ABRecord, PreferencePair, read_jsonl
from components.core.tracking import PhaseRun, local_tracking_uri, start_pipeline_run
from components.dpo import run
from components.sandbox.suites import load_sandbox
from tests.helpers.runtime import tiny_on_sandbox

pytestmark = pytest.mark.slow


def test_dpo_phase_on_simulated_ab_logs(tmp_path, monkeypatch):
    overrides = {"run": {"home": str(tmp_path / "home")}, "sandbox": {"max_turns": 3, "suite_sizes": {"safety": 6}},
                 "generation": {"max_new_tokens": 24},
                 "dpo": {"simulate": {"requests": 8, "answers_per_variant": 2, "correction_rate": 1.0, "noise_rate": 0.0},
                         "epochs": 4, "sft_weight": 0.0,  # plain DPO: its loss starts at ln 2 (below)
                         "learning_rate": 1e-3, "batch_size": 4, "min_pairs": 4, "heldout_fraction": 0.25},
                 "sft": {"eval_suites": []}}
    cfg = load_config(overrides_json=json.dumps(overrides))
    sb = load_sandbox(cfg)
    model = tiny_on_sandbox(tmp_path / "tiny", cfg.sandbox, sb.world, sb.suites, n_demos=20)
    parent = start_pipeline_run(local_tracking_uri(tmp_path / "home"), "agentrl", "dpo-test")
    # what serves today: a champion in the registry is the simulated deployment's variant A
    with PhaseRun("eval", config=cfg, parent_run_id=parent) as earlier:
        earlier.log_artifact(str(model), "model")
        champion = earlier.register_model("model", alias="champion")
    res = run(overrides=json.dumps(overrides), policy_model=str(model), parent_run_id=parent,
              work_dir=str(tmp_path / "work"))

    logs = list(read_jsonl(tmp_path / "work" / "ab_logs" / "simulated.jsonl", ABRecord))
    assert len(logs) == 32 and {r.variant for r in logs} == {"A", "B"}
    per_request = {}
    for r in logs:  # two answers of each variant to every request
        per_request.setdefault(r.request_id, []).append(r.variant)
    assert len(per_request) == 8 and all(sorted(v) == ["A", "A", "B", "B"] for v in per_request.values())
    a_models = {r.model_id for r in logs if r.variant == "A"}
    assert len(a_models) == 1 and "champion" in a_models.pop() and {r.model_id for r in logs if r.variant == "B"} == {
        str(model)}
    # an untrained model never solves a task: every answer is a thumbs-down, corrected by the expert
    assert all(r.feedback.thumb == "down" for r in logs)
    assert sum(r.feedback.correction is not None for r in logs) >= 12
    train = list(read_jsonl(tmp_path / "work" / "pairs" / "train.jsonl", PreferencePair))
    assert len(train) == res.metrics["pairs_train"] >= 4
    # DPO starts at loss ln 2 (policy == reference) and learns to separate its training pairs
    assert res.metrics["train_loss"] < math.log(2) - 0.02
    assert 0.0 <= res.metrics["safety/safety_violation_rate"] <= 1.0
    assert res.metrics["safety_regression"] in (0.0, 1.0)
    card = json.loads((tmp_path / "work" / "model" / "agentrl.json").read_text())
    assert card["phase"] == "dpo" and card["base_model"] == str(model)

    # a KFP retry of the step (the pod died after training): the simulated logs and the finished checkpoint
    # are reused — no new simulation, no training step, the same weights, one MLflow run
    weights = (tmp_path / "work" / "model" / "model.safetensors").read_bytes()
    again = run(overrides=json.dumps(overrides), policy_model=str(model), parent_run_id=parent,
              work_dir=str(tmp_path / "work"))
    assert again.run_id == res.run_id
    assert again.metrics["resumed_from"] == again.metrics["train_steps"] == res.metrics["train_steps"]
    assert (tmp_path / "work" / "model" / "model.safetensors").read_bytes() == weights
    client = MlflowClient(local_tracking_uri(tmp_path / "home"))
    run_ = client.get_run(res.run_id)
    assert run_.data.tags["agentrl.dpo.resumed"]
    assert run_.data.tags["agentrl.dpo.variant_a"] == f"champion version {champion.version}"
    assert len(client.get_metric_history(res.run_id, "dpo/ab_sim/requests")) == 1
