"""The embedded default learns: sandbox -> tiny base (with its copy pretraining) -> SFT, then the held-out easy
suite (issue 5's target: >= 50 % TGC after <= 6 minutes of SFT).

The pipeline's own recipes on the default config, with two changes that make the outcome independent of the
machine's load: SFT is bounded by steps, not by the preset's 6-minute budget (800 steps: what that budget gives on
2 free cores, 877 in CI's run of 2026-12-06), and everything runs on one CPU thread, so `make test` can run this test
beside the rest of the suite. Slow (~38 minutes on one core beside the main suite, 28 of them the base's copy
pretraining). On one thread the outcome repeats exactly (two runs: easy TGC 0.55, valid actions 0.735, SFT loss
0.5361).
"""

from __future__ import annotations

import json

import pytest

from components.prepare.recipe import run as prepare
from components.sandbox.recipe import run as build_sandbox
from components.sft.recipe import run as sft

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

SFT_STEPS = 800


def test_sft_on_the_embedded_default_solves_most_easy_tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_HOME", str(tmp_path / "home"))
    overrides = json.dumps({"run": {"home": str(tmp_path / "home"), "torch_threads": 1},
                            "model": {"tiny": {"pretrain_threads": 1}},
                            "sft": {"max_steps": SFT_STEPS, "max_minutes": None, "torch_threads": 1}})
    box = build_sandbox(overrides=overrides, out_dir=str(tmp_path / "sandbox"))
    base = prepare(overrides=overrides, model_out=str(tmp_path / "base"), parent_run_id=box.parent_run_id,
                   corpus=str(tmp_path / "sandbox" / "corpus.txt"))
    card = json.loads((tmp_path / "base" / "agentrl.json").read_text())["extra"]
    assert card["copy_accuracy_before"] < 0.05 and card["copy_accuracy"] > 0.8, card  # the base can copy ...
    # ... from 128 tokens back too, and digit strings (a one-token match miscopies those: ~0.1 at chance)
    assert card["copy_accuracy_reach"] > 0.8 and card["copy_accuracy_reach_digits"] > 0.6, card
    result = sft(overrides=overrides, base_model=base.model_dir, demos=str(tmp_path / "sandbox" / "demos"),
                 tasks_dir=str(tmp_path / "sandbox" / "tasks"), parent_run_id=box.parent_run_id,
                 model_out=str(tmp_path / "sft"))
    m = result.metrics
    assert m["train_steps"] == SFT_STEPS
    print({k: m[k] for k in ("train_steps", "train_loss", "easy/tgc", "easy/valid_action_rate")}, card)
    # ... and SFT on the expert demos turns that into solved held-out tasks (0.0 without the pretraining)
    assert m["easy/tgc"] >= 0.5, m
    # a floor, not the target: the failed episodes' retries are most of the format errors, so this rate moves with
    # the TGC (0.735, 0.779 and > 0.8 in three runs on the reach base; ~0 for a base that cannot act)
    assert m["easy/valid_action_rate"] >= 0.7, m
