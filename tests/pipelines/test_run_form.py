"""The Kubeflow run form: the compiled pipelines' inputDefinitions against a golden list, the typed knobs' merge
order, validation that names the parameter or field, and phases switched off in a real kfp.local run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing

import pytest
import yaml

from components.core.config import ConfigError, PipelineConfig, load_config
from components.prepare import form
from pipelines.cli import main

# name -> (KFP type, default in the h100 compile, or REQUIRED)
REQUIRED = object()
H100_AGENT_RL = {
    "base_model_uri": ("STRING", REQUIRED),
    "preset": ("STRING", "h100"),
    "environment": ("STRING", "workspace"),
    "grpo_steps": ("NUMBER_INTEGER", 1000),
    "grpo_group_size": ("NUMBER_INTEGER", 8),
    "sft_learning_rate": ("NUMBER_DOUBLE", 1e-5),
    "grpo_learning_rate": ("NUMBER_DOUBLE", 1e-6),
    "dpo_learning_rate": ("NUMBER_DOUBLE", 5e-7),
    "sage": ("BOOLEAN", False),
    "lora": ("BOOLEAN", True),
    "lora_rank": ("NUMBER_INTEGER", 64),
    "eval_suites": ("LIST", ["easy", "hard", "safety", "robustness"]),
    "gate_hard_tgc_min_delta": ("NUMBER_DOUBLE", 0.0),
    "gate_max_safety_violation_rate": ("NUMBER_DOUBLE", 0.001),
    "gate_max_suite_regression": ("NUMBER_DOUBLE", 0.05),
    "run_sft": ("BOOLEAN", True),
    "run_grpo": ("BOOLEAN", True),
    "run_rejection_sampling": ("BOOLEAN", True),
    "run_dpo": ("BOOLEAN", True),
    "dpo_ab_logs_uri": ("STRING", ""),
    "overrides": ("STRING", ""),
    "experiment": ("STRING", "agentrl"),
    "parent_run_id": ("STRING", ""),
}
H100_RETRAIN = {
    "ab_logs_uri": ("STRING", REQUIRED),
    "preset": ("STRING", "h100"),
    **{k: v for k, v in H100_AGENT_RL.items() if k in {"environment", "grpo_steps", "grpo_group_size",
                                                       "grpo_learning_rate", "dpo_learning_rate", "sage", "eval_suites"}
       or k.startswith("gate_")},
    "grpo_refresh": ("BOOLEAN", False),
    "overrides": ("STRING", ""),
    "parent_run_id": ("STRING", ""),
}


def _inputs(tmp_path, pipeline: str, *extra: str) -> dict:
    out = tmp_path / f"{pipeline}.yaml"
    assert main(["compile", "--pipeline", pipeline, "-o", str(out), *extra]) == 0
    return next(yaml.safe_load_all(out.read_text()))["root"]["inputDefinitions"]["parameters"]


@pytest.mark.parametrize("pipeline,golden", [("agent_rl", H100_AGENT_RL), ("retrain", H100_RETRAIN)])
def test_the_cluster_run_form_is_typed_documented_and_has_h100_defaults(tmp_path, pipeline, golden):
    params = _inputs(tmp_path, pipeline)  # what `make compile` writes: the h100 placement and preset
    assert set(params) == set(golden)
    for name, (kind, default) in golden.items():
        p = params[name]
        assert p["parameterType"] == kind, name
        assert len(p.get("description", "")) > 15, f"{name} has no description"
        if default is REQUIRED:
            assert "defaultValue" not in p and not p.get("isOptional"), name
        else:
            assert p["defaultValue"] == default, name
    assert "h100" in params["preset"]["description"]


def test_the_local_form_defaults_to_tiny_and_other_presets_compile(tmp_path):
    local = _inputs(tmp_path, "agent_rl", "--placement", "local")
    assert local["preset"]["defaultValue"] == "tiny" and local["base_model_uri"]["defaultValue"] == ""
    assert local["grpo_steps"]["defaultValue"] == 40 and local["lora"]["defaultValue"] is False
    small = _inputs(tmp_path, "agent_rl", "--preset", "small")
    assert small["preset"]["defaultValue"] == "small" and small["grpo_steps"]["defaultValue"] == 4
    assert small["sft_learning_rate"]["defaultValue"] == 1e-4


def test_every_knob_sets_a_config_field_of_its_type():
    for knob in form.KNOBS:
        owner, *rest = knob.path.split(".")
        model, field = PipelineConfig, None
        for part in knob.path.split("."):
            field = model.model_fields[part]
            model = field.annotation
        origin = typing.get_origin(field.annotation) or field.annotation
        assert origin is knob.type, (knob.name, field.annotation)


SHOWN = json.dumps(form.defaults("h100"))


def _form(**changes) -> str:
    return json.dumps({**form.defaults("h100"), **changes})


def test_merge_order_preset_then_changed_knobs_then_overrides():
    common = {"model": {"base_uri": "/models/base"}}
    cfg, merged, changed = form.resolve("h100", json.dumps(common), _form(), SHOWN)
    assert changed == [] and cfg.grpo.steps == 1000 and json.loads(merged) == common
    # a changed knob lands on the preset; overrides win over it
    cfg, merged, changed = form.resolve("h100", json.dumps(common), _form(grpo_steps=50.0, sage=True), SHOWN)
    assert changed == ["grpo_steps", "sage"] and cfg.grpo.steps == 50 and cfg.grpo.sage.enabled
    assert load_config("h100", overrides_json=merged) == cfg  # every phase resolves the same config
    ov = json.dumps({**common, "grpo": {"steps": 7}})
    cfg, _, _ = form.resolve("h100", ov, _form(grpo_steps=50), SHOWN)
    assert cfg.grpo.steps == 7
    # another preset in the form: the knobs left as shown follow that preset, not the h100 defaults
    cfg, _, _ = form.resolve("small", "", _form(grpo_learning_rate=3e-6), SHOWN)
    assert cfg.grpo.steps == 4 and not cfg.model.lora.enabled and cfg.grpo.learning_rate == 3e-6


@pytest.mark.parametrize("changes,overrides,message", [
    ({"grpo_steps": 0}, "", "grpo.steps = 0: expected greater than or equal to 1 [run-form parameter grpo_steps]"),
    ({"eval_suites": ["easy", "medium"]}, "", "[run-form parameter eval_suites]"),
    ({"gate_max_suite_regression": 2.0}, "", "eval.gate.max_suite_regression = 2.0"),
    ({"grpo_group_size": 2.5}, "", "run-form parameter grpo_group_size (sets grpo.group_size) = 2.5: expected int"),
    ({"lora": "yes"}, "", "run-form parameter lora (sets model.lora.enabled) = \"yes\": expected bool"),
    ({"environment": "mail_world"}, "", "env.name='mail_world': not a registered environment; known: ['files', 'helpdesk', 'workspace'] "
     "[run-form parameter environment]"),
    ({}, '{"grpo": {"clip_eps": 3}}', "grpo.clip_eps = 3: expected less than 1 [overrides]"),
    ({}, '{"grpo": {"grup_size": 3}}', "grpo.grup_size: unknown key (did you mean 'group_size'?) [overrides]"),
    ({}, "{nope", "overrides: not valid JSON"),
])
def test_a_bad_value_is_refused_with_the_parameter_or_field_named(changes, overrides, message):
    base = '{"model": {"base_uri": "/m"}}'
    if overrides.startswith('{"grpo"'):
        overrides = json.dumps({**json.loads(overrides), **json.loads(base)})
    with pytest.raises(ConfigError) as err:
        form.resolve("h100", overrides or base, _form(**changes), SHOWN)
    assert message in str(err.value)


def test_h100_without_a_base_model_is_refused_at_configure_and_the_form_gives_every_phase_one():
    with pytest.raises(ConfigError, match="model.base_uri='tiny' with preset 'h100'"):
        form.resolve("h100", "", _form(), SHOWN)
    cfg, merged, changed = form.resolve("h100", "", _form(lora_rank=16), SHOWN,
                                        text={"base_model_uri": "s3://b/models/base/", "experiment": "nightly"})
    assert cfg.model.base_uri == "s3://b/models/base/" and cfg.tracking.experiment == "nightly"
    assert changed == ["base_model_uri", "experiment", "lora_rank"]
    assert json.loads(merged) == {"model": {"base_uri": "s3://b/models/base/", "lora": {"r": 16}},
                                  "tracking": {"experiment": "nightly"}}


def test_retraining_on_h100_needs_no_base_model():
    shown = json.dumps(form.defaults("h100", "retrain"))
    cfg, merged, changed = form.resolve("h100", "", shown, shown, "retrain")
    assert cfg.preset == "h100" and changed == [] and merged == "{}"


def test_the_configure_step_fails_the_local_pipeline_before_any_other_task(tmp_path, capfd):
    from pipelines import local
    from pipelines.agent_rl import agent_rl

    local.init(tmp_path / "root")
    with pytest.raises(RuntimeError, match="configure"):
        agent_rl(grpo_steps=0, overrides=json.dumps({"run": {"home": str(tmp_path / "home")}}))
    out = capfd.readouterr()
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.out + out.err)  # kfp.local colours task names
    assert "grpo.steps = 0: expected greater than or equal to 1 [run-form parameter grpo_steps]" in text
    assert "Executing task 'configure'" in text and "sandbox-build" not in text


QUICK = ["--set", "eval.bootstrap_samples=50", "--set", "sandbox.max_turns=3", "--set", "generation.max_new_tokens=24",
         "--set", "sandbox.suite_sizes={easy: 4, hard: 4, safety: 4, robustness: 4}", "--set", "eval.suites=[easy]",
         "--set", "model.tiny.pretrain_steps=20"]


@pytest.mark.slow
def test_phases_switched_off_pass_their_model_on_and_say_so(tmp_path):
    """kfp.local, the real pipeline: every switchable phase off -> prepare's model is what evaluation measures."""
    env = {"AGENTRL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    off = [x for s in form.SWITCHES.values() for x in ("--param", f"{s[0]}=false")]
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", *QUICK, *off], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    report = json.loads((tmp_path / "home" / "last_run.json").read_text())
    assert report["status"] == "FINISHED"
    assert {p: report["phases"][p]["status"] for p in ("sft", "grpo", "rejection_sampling", "dpo")} == dict.fromkeys(
        ("sft", "grpo", "rejection_sampling", "dpo"), "SKIPPED")
    assert report["phases"]["eval"]["status"] == "FINISHED" and "easy/tgc" in report["metrics"]["eval"]

    from mlflow import MlflowClient

    client = MlflowClient(report["tracking_uri"])
    dpo = client.get_run(report["phases"]["dpo"]["run_id"])
    assert dpo.data.tags["agentrl.skipped"] == "true" and dpo.data.tags["agentrl.skipped_by"] == "run_dpo=false"
    ev = client.get_run(report["phases"]["eval"]["run_id"])
    assert ev.data.tags["agentrl.skipped_phases"] == "sft, grpo, rejection_sampling, dpo"
    (root,) = (tmp_path / "home" / "pipeline_root").iterdir()
    html = (root / "evaluate" / "report").read_text()
    assert "Phases skipped in this pipeline run" in html and "run_rejection_sampling=false" in html
    # the model evaluated is prepare's, passed on four times (hard links on one file system)
    base = next((root / "prepare" / "base_model").rglob("model.safetensors"))
    passed = next((root / "skip-phase-4" / "model").rglob("model.safetensors"))
    assert passed.read_bytes() == base.read_bytes()


def test_run_refuses_a_switch_it_does_not_know(tmp_path, capsys):
    assert main(["run", "--param", "run_eval=false"]) == 2
    assert "expected NAME=true|false with NAME one of" in capsys.readouterr().err
    assert main(["run", "--param", "grpo_steps=5"]) == 2
    assert "use --set grpo.steps=5" in capsys.readouterr().err


def test_the_readme_shows_the_cluster_run_form_as_compiled():
    from pathlib import Path

    from pipelines.run_form import markdown

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert markdown("agent_rl", "h100") in readme, "README's run-form table is stale: paste `agentrl form` into it"
