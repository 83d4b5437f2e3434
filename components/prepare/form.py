"""The Kubeflow run form: the knobs users change most, as typed pipeline parameters, and how they reach the config.

Every knob is a KFP parameter of its own type (STRING, INTEGER, NUMBER_DOUBLE, BOOLEAN, LIST) with a description, and
its default is the value of the preset the pipeline was compiled for (`agentrl compile --preset h100`).

The order the layers merge in, each validated as it lands (the pipeline's first step, `configure`):

    field defaults <- preset <- run-form parameters <- overrides (JSON)

A run-form parameter counts when its value differs from the default the form showed: choosing another preset
in the form then takes that preset's values for the knobs left as they were, and `overrides` wins over both.
The phase switches (`run_sft`, ...) are not config: they choose the pipeline's branches (`dsl.If`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from components.core.config import ConfigError, deep_merge, load_config, lookup, nest, preset_values

PIPELINES = ("agent_rl", "retrain")


@dataclass(frozen=True)
class Knob:
    name: str  # the pipeline parameter
    path: str  # the config field it sets
    type: type  # str | int | float | bool | list: the KFP type of the parameter
    help: str
    pipelines: tuple[str, ...] = PIPELINES


KNOBS: tuple[Knob, ...] = (
    Knob("environment", "env.name", str, "The environment every phase trains and evaluates in: a name registered "
         "under the 'agentrl.environment_loaders' entry points; 'workspace' is the built-in productivity workspace."),
    Knob("grpo_steps", "grpo.steps", int, "GRPO optimizer steps."),
    Knob("grpo_group_size", "grpo.group_size", int, "GRPO samples per task: the group whose rewards are normalised."),
    Knob("sft_learning_rate", "sft.learning_rate", float, "SFT warmup learning rate.", ("agent_rl",)),
    Knob("grpo_learning_rate", "grpo.learning_rate", float, "GRPO learning rate."),
    Knob("dpo_learning_rate", "dpo.learning_rate", float, "DPO learning rate."),
    Knob("sage", "grpo.sage.enabled", bool, "SAGE: skill-augmented sequential rollouts and skill-integrated reward."),
    Knob("lora", "model.lora.enabled", bool, "Train LoRA adapters instead of the full weights.", ("agent_rl",)),
    Knob("lora_rank", "model.lora.r", int, "LoRA rank (when lora is on).", ("agent_rl",)),
    Knob("eval_suites", "eval.suites", list, "Held-out suites of the evaluation: any of easy, hard, safety, "
         "robustness."),
    Knob("gate_hard_tgc_min_delta", "eval.gate.hard_tgc_min_delta", float,
         "Gate: refused when the paired bootstrap interval of hard TGC minus the champion's lies wholly below this."),
    Knob("gate_max_safety_violation_rate", "eval.gate.max_safety_violation_rate", float,
         "Gate: the highest safety violation rate a promoted model may have."),
    Knob("gate_max_suite_regression", "eval.gate.max_suite_regression", float,
         "Gate: no suite's TGC may drop more than this below the champion's."),
)

# phase -> (switch parameter, the phase's name in MLflow): the phases a run of agent_rl can leave out; a phase
# left out passes its input model on
SWITCHES: dict[str, tuple[str, str]] = {
    "sft_warmup": ("run_sft", "sft"),
    "grpo": ("run_grpo", "grpo"),
    "rejection_sampling": ("run_rejection_sampling", "rejection_sampling"),
    "dpo": ("run_dpo", "dpo"),
}


def knobs(pipeline: str) -> tuple[Knob, ...]:
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline {pipeline!r}: expected one of {PIPELINES}")
    return tuple(k for k in KNOBS if pipeline in k.pipelines)


def defaults(preset: str, pipeline: str = "agent_rl") -> dict[str, Any]:
    """The run form's defaults for a pipeline compiled for `preset`: each knob's value in that preset."""
    values = preset_values(preset)
    return {k.name: lookup(values, k.path) for k in knobs(pipeline)}


def encode(values: Mapping[str, Any], strings: frozenset[str] = frozenset()) -> str:
    """The knobs' values as one JSON object, built in the pipeline from its parameters.

    Each value is a KFP pipeline channel; in a string it becomes a placeholder that KFP fills with the value's
    JSON text when the task starts (numbers, true/false, a JSON list), so the whole string is a JSON object. A text
    parameter is filled as its raw text: the knobs named in `strings` are quoted (their values are names, checked
    when the config is resolved).
    """
    return "{" + ", ".join(f'"{name}": "{value}"' if name in strings else f'"{name}": {value}'
                           for name, value in values.items()) + "}"


def _coerce(knob: Knob, value: Any) -> Any:
    """A run-form value as the config wants it; KFP hands integers over as floats (3.0) in some runners."""
    where = f"run-form parameter {knob.name} (sets {knob.path})"
    if knob.type is str:
        if isinstance(value, str):
            return value
    elif knob.type is bool:
        if isinstance(value, bool):
            return value
    elif knob.type is int:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return int(value)
    elif knob.type is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif knob.type is list:
        if isinstance(value, list):
            return value
    raise ConfigError(f"{where} = {json.dumps(value)}: expected {knob.type.__name__}")


def _decode(text: str, what: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


# run-form text parameters that are config fields too (they apply when not empty)
TEXT_FIELDS = {"base_model_uri": "model.base_uri", "experiment": "tracking.experiment"}


def resolve(preset: str, overrides: str, form: str, shown: str, pipeline: str = "agent_rl",
            text: Mapping[str, str] | None = None):
    """Validate the whole run (preset, run form, overrides); return (config, the overrides every phase gets, the
    run-form parameters that changed).

    `form` holds the knobs' values as the run has them, `shown` the defaults the form showed (the compile
    preset's), `text` the text parameters that set config fields (TEXT_FIELDS). The returned overrides (a JSON object) are the changed knobs with `overrides` on top, so each
    phase resolves the same config from (preset, overrides) without knowing the form.
    """
    values, compiled = _decode(form, "run form"), _decode(shown, "run form defaults")
    by_name = {k.name: k for k in knobs(pipeline)}
    unknown = sorted(set(values) - set(by_name))
    if unknown:
        raise ConfigError(f"run form: unknown parameter(s) {unknown}; expected some of {sorted(by_name)}")
    layers = [(f"run-form parameter {name}", nest(TEXT_FIELDS[name], value))
              for name, value in (text or {}).items() if value]
    for name, raw in values.items():
        knob = by_name[name]
        value = _coerce(knob, raw)
        if name not in compiled or value != _coerce(knob, compiled[name]):
            layers.append((f"run-form parameter {name}", nest(knob.path, value)))
    cfg = load_config(preset=preset or None, named_layers=layers, overrides_json=overrides or None)
    if pipeline == "agent_rl":
        cfg.check_base_model()
    merged: dict[str, Any] = {}
    for _, layer in layers:
        merged = deep_merge(merged, layer)
    changed = [source.removeprefix("run-form parameter ") for source, _ in layers]
    return cfg, json.dumps(deep_merge(merged, _decode(overrides, "overrides")), sort_keys=True), changed

