from __future__ import annotations

import json
import re

import pytest

from components.core.config import PRESETS, ConfigError, PipelineConfig, flatten, load_config, parse_set


def test_defaults_are_the_tiny_preset():
    cfg = load_config()
    assert cfg.preset == "tiny" and cfg.model.base_uri == "tiny" and cfg.run.torch_threads == 1


def test_h100_preset_with_a_model():
    cfg = load_config(preset="h100", set_pairs=["model.base_uri=s3://models/qwen"])
    assert cfg.sft.deepspeed == "zero3" and cfg.generation.backend == "vllm" and cfg.sft.bf16
    assert cfg.grpo.group_size == 8 and cfg.grpo.tasks_per_step == 256


def test_layers_apply_in_order(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("grpo:\n  group_size: 6\n  steps: 5\nsft:\n  learning_rate: 0.01\n")
    cfg = load_config(files=[f], overrides_json='{"grpo": {"steps": 7}}', set_pairs=["grpo.steps=9"])
    assert (cfg.grpo.group_size, cfg.grpo.steps, cfg.sft.learning_rate) == (6, 9, 0.01)


def test_set_coerces_types():
    cfg = load_config(set_pairs=[
        "grpo.group_size=16", "model.lora.enabled=true", "grpo.clip_eps_high=0.28",
        "eval.suites=[easy, hard]", "sft.data_uri=s3://b/demos.jsonl", "eval.baseline=null",
        "grpo.curriculum.start_mix={1: 0.5, 2: 0.5}",
    ])
    assert cfg.grpo.group_size == 16 and cfg.model.lora.enabled is True
    assert cfg.eval.suites == ["easy", "hard"] and cfg.sft.data_uri == "s3://b/demos.jsonl"
    assert cfg.grpo.curriculum.start_mix == {1: 0.5, 2: 0.5}


def test_exponent_floats_as_json_reads_them(tmp_path):
    """PyYAML (YAML 1.1) reads 5e-5 as the string '5e-5'; a learning rate written that way must be the number."""
    cfg = load_config(set_pairs=["dpo.learning_rate=5e-5", "grpo.learning_rate=2E-6"])
    assert (cfg.dpo.learning_rate, cfg.grpo.learning_rate) == (5e-5, 2e-6)
    f = tmp_path / "c.yaml"
    f.write_text("sft:\n  learning_rate: 3e-4\n")
    assert load_config(files=[f]).sft.learning_rate == 3e-4
    assert load_config(set_pairs=["sft.data_uri=runs/5e3"]).sft.data_uri == "runs/5e3"  # not a number: text


def test_preset_from_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: h100\nmodel:\n  base_uri: /models/llama\n")
    assert load_config(files=[f]).sft.deepspeed == "zero3"


def test_async_section_is_written_as_users_write_it():
    cfg = load_config(set_pairs=["grpo.async.max_staleness=1"])
    assert cfg.grpo.async_.max_staleness == 1 and cfg.to_dict()["grpo"]["async"]["max_staleness"] == 1
    assert PipelineConfig.model_validate(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.grpo.async_.active_correction("hf") == "tis"  # 'auto': the sampler lags the learner
    assert load_config().grpo.async_.active_correction("hf") == "none"
    assert load_config().grpo.async_.active_correction("vllm") == "tis"  # another engine samples


def test_roundtrip_and_flatten():
    cfg = load_config(set_pairs=["grpo.group_size=5"])
    again = PipelineConfig.model_validate(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    flat = flatten(cfg.to_dict())
    assert flat["grpo.group_size"] == 5 and flat["model.lora.r"] == 8
    assert json.loads(flat["grpo.curriculum.final_mix"]) == {"1": 0.1, "2": 0.15, "3": 0.25, "4": 0.3, "5": 0.2}
    assert all(not isinstance(v, (dict, list)) for v in flat.values())


BAD = [
    # (layer kwargs, text the error must contain — always the field's dotted name)
    (dict(set_pairs=["grpo.grup_size=3"]), "grpo.grup_size: unknown key (did you mean 'group_size'?)"),
    (dict(overrides_json='{"sfft": {"epochs": 1}}'), "sfft: unknown key (did you mean 'sft'?)"),
    (dict(set_pairs=["grpo.group_size=abc"]), 'grpo.group_size = "abc": expected a valid integer'),
    (dict(set_pairs=["grpo.group_size=1"]), "grpo.group_size = 1: expected greater than or equal to 2"),
    (dict(set_pairs=["sft.learning_rate=-0.1"]), "sft.learning_rate = -0.1: expected greater than 0"),
    (dict(set_pairs=["generation.backend=tpu"]), "generation.backend = \"tpu\": expected 'hf' or 'vllm'"),
    (dict(set_pairs=["grpo.curriculum.start_mix={1: 0.5}"]), "grpo.curriculum.start_mix: weights must sum to 1"),
    (dict(set_pairs=["grpo.curriculum.final_mix={7: 1.0}"]), "grpo.curriculum.final_mix: levels must be 1..5"),
    (dict(set_pairs=["rejection_sampling.top_k=32"]), "rejection_sampling.top_k=32 must be <= rejection_sampling.num_samples=16"),
    (dict(set_pairs=["model.tiny.num_heads=3"]), "model.tiny.hidden_size=256 must be divisible by model.tiny.num_heads=3"),
    (dict(set_pairs=["model.base_uri=hf://meta/llama"]), "model.base_uri='hf://meta/llama'"),
    (dict(set_pairs=["sft.deepspeed=zero4"]), "sft.deepspeed='zero4'"),
    (dict(set_pairs=["grpo.clip_eps_high=0.1"]), "grpo.clip_eps_high=0.1 must be >= grpo.clip_eps=0.2"),
    (dict(set_pairs=["generation.max_new_tokens=3000"]), "generation.max_new_tokens=3000 must be <"),
    (dict(set_pairs=["sandbox.suite_sizes.medium=3"]), "sandbox.suite_sizes.medium"),
    (dict(set_pairs=["eval.suites=[easy, extreme]"]), "eval.suites.1 = 'extreme': the workspace has the suites"),
    (dict(preset="tpu-pod"), "preset = 'tpu-pod'"),
    (dict(set_pairs=["run.seed"]), "--set 'run.seed': expected section.field=value"),
    (dict(overrides_json="{not json"), "overrides: not valid JSON"),
    (dict(overrides_json="[1, 2]"), "overrides: expected a JSON object"),
    (dict(set_pairs=["grpo.sage.enabled=maybe"]), 'grpo.sage.enabled = "maybe": expected a valid boolean'),
    (dict(set_pairs=["dpo.simulate.noise_rate=0.9"]), "dpo.simulate.noise_rate = 0.9"),
    (dict(set_pairs=["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"]), "dpo.label_smoothing=0.1 applies to"),
    (dict(set_pairs=["dpo.label_smoothing=0.5"]), "dpo.label_smoothing = 0.5"),
    (dict(set_pairs=["dpo.simulate.levels=[0]"]), "dpo.simulate.levels.0 = 0"),
    (dict(set_pairs=["rejection_sampling.levels=[3, 6]"]), "rejection_sampling.levels.1 = 6: expected less than or equal to 5"),
    (dict(set_pairs=["rejection_sampling.levels=[]"]), "rejection_sampling.levels = []"),
    (dict(set_pairs=["grpo.async.max_stalenes=1"]), "grpo.async.max_stalenes: unknown key (did you mean 'max_staleness'?)"),
    (dict(set_pairs=["grpo.async.max_staleness=-1"]), "grpo.async.max_staleness = -1: expected greater than or equal to 0"),
    (dict(set_pairs=["grpo.async.correction=tis", "grpo.temperature=0.7"]),
     "grpo.async.correction needs grpo.temperature=1.0 (got 0.7)"),
    (dict(set_pairs=["grpo.async.max_staleness=1", "grpo.deepspeed=zero2"]),
     "grpo.async.max_staleness > 0 with grpo.deepspeed"),
]


@pytest.mark.parametrize("kwargs,expected", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_config_names_the_field(kwargs, expected):
    with pytest.raises(ConfigError) as err:
        load_config(**kwargs)
    assert expected in str(err.value), str(err.value)


def test_bad_yaml_file_is_named(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("grpo: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        load_config(files=[f])
    g = tmp_path / "typo.yaml"
    g.write_text("grpo:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"grpo.stepz: unknown key \(did you mean 'steps'\?\) \[.*typo.yaml\]"):
        load_config(files=[g])
    with pytest.raises(ConfigError, match="missing.yaml: not found"):
        load_config(files=[tmp_path / "missing.yaml"])


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(overrides_json='{"grpo": {"group_size": 0, "steps": -1}}')
    assert "grpo.group_size" in str(err.value) and "grpo.steps" in str(err.value)


def test_parse_set_nested_dict_fields():
    assert parse_set(["sandbox.suite_sizes.easy=3"]) == {"sandbox": {"suite_sizes": {"easy": 3}}}


def test_presets_are_valid():
    for name in PRESETS:
        load_config(preset=name, set_pairs=[] if name == "tiny" else ["model.base_uri=/m"])


def test_presets_are_yaml_files_a_user_can_copy(tmp_path):
    """Each preset is a data file in components/core/configs/; a copy of it, edited and passed as a config file on the
    tiny defaults, gives the preset's config with the edit."""
    from components.core.config import PRESET_DIR

    assert sorted(p.stem for p in PRESET_DIR.glob("*.yaml")) == sorted(PRESETS) == ["h100", "small", "tiny"]
    text = (PRESET_DIR / "small.yaml").read_text()
    assert text.startswith("#") and "learning_rate: 1.0e-4" in text  # commented; floats YAML reads as floats
    copy = tmp_path / "mine.yaml"
    copy.write_text(text.replace("group_size: 4", "group_size: 6"))
    mine, small = load_config(files=[copy]), load_config(preset="small")
    assert mine.grpo.group_size == 6 and small.grpo.group_size == 4
    assert mine.model_copy(update={"preset": "small", "grpo": small.grpo}).to_dict() == small.to_dict()


def test_small_preset_is_smollm2_full_fine_tune_and_validates():
    cfg = load_config(preset="small")
    assert cfg.preset == "small" and cfg.model.base_uri == "smollm2-135m-instruct" and not cfg.model.lora.enabled
    assert cfg.model.observation_role == "auto" and cfg.model.chat_template is None
    # the small preset keeps the held-out suites small enough for a CPU run, the rest of the world as tiny's
    assert cfg.sandbox.suite_sizes == {"easy": 20, "hard": 20, "safety": 10, "robustness": 10}
    assert cfg.sandbox.model_dump(exclude={"suite_sizes"}) == load_config().sandbox.model_dump(exclude={"suite_sizes"})
    with pytest.raises(ConfigError, match="model.observation_role"):
        load_config(preset="small", set_pairs=["model.observation_role=system"])


def test_h100_needs_a_base_model_where_one_is_brought_in():
    cfg = load_config(preset="h100")  # retraining starts from the champion: no base model needed
    with pytest.raises(ConfigError, match="model.base_uri='tiny' with preset 'h100'"):
        cfg.check_base_model()
    load_config(preset="h100", set_pairs=["model.base_uri=s3://b/m/"]).check_base_model()


@pytest.mark.parametrize("pair,message", [
    ("sandbox.max_turns=true", "sandbox.max_turns = true: expected a valid integer [--set]"),
    ("sandbox.max_turns='12'", 'sandbox.max_turns = "12": expected a valid integer [--set]'),
    ("grpo.sage.enabled=1", "grpo.sage.enabled = 1: expected a valid boolean [--set]"),
    ("sft.learning_rate=fast", 'sft.learning_rate = "fast": expected a valid number [--set]'),
    ("sft.max_steps=" + "9" * 5000, "cannot be read (ValueError)"),
])
def test_types_are_strict(pair, message):
    with pytest.raises(ConfigError) as err:
        load_config(set_pairs=[pair])
    assert message in str(err.value)
    # numbers where numbers belong still pass: an int for a float field, JSON's string level keys
    cfg = load_config(overrides_json='{"sft": {"epochs": 3}, "grpo": {"curriculum": {"start_mix": {"1": 0.5, "2": 0.5}}}}')
    assert cfg.sft.epochs == 3.0 and cfg.grpo.curriculum.start_mix == {1: 0.5, 2: 0.5}


@pytest.mark.parametrize("content,message", [
    (b"sft:\n  epochs: 2\n  epochs: 3\n", "not valid YAML (duplicate key 'epochs'"),
    (b"sft:\n  epochs: \xff\n", "not UTF-8 text (byte 15)"),
    (("a: " + "[" * 20000 + "]" * 20000).encode(), "cannot be read as a config (RecursionError"),
    (b"sft:\n  max_steps: " + b"9" * 5000 + b"\n", "cannot be read as a config (ValueError"),
])
def test_unreadable_config_files_are_errors_naming_the_file(tmp_path, content, message):
    f = tmp_path / "bad.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(files=[f])
    assert str(err.value).startswith(f"config file {f}: ") and message in str(err.value)


@pytest.mark.parametrize("text,message", [
    ('{"a": ' + "[" * 30000 + "]" * 30000 + "}", "overrides: cannot be read as a config (RecursionError"),
    ('{"sft": {"max_steps": ' + "9" * 5000 + "}}", "overrides: cannot be read as a config (ValueError"),
])
def test_unreadable_overrides_are_errors(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides_json=text)


def test_env_section_names_a_registered_environment_checked_before_any_work():
    from components.core import env as environments

    cfg = load_config()
    assert cfg.env.name == "workspace" and cfg.env.options == {} and cfg.env.url is None
    assert "workspace" in environments.loader_names()
    with pytest.raises(ConfigError, match=r"env.name='mail_world': not a registered environment; known: .*workspace"):
        load_config(set_pairs=["env.name=mail_world"])
    with pytest.raises(ConfigError, match=r"env.url='ftp://x': expected an http:// or https:// URL"):
        load_config(set_pairs=["env.url=ftp://x"])
    # the workspace's settings are its `sandbox` section: options for its loader are refused by name
    with pytest.raises(ValueError, match=r"env.options=\['users'\]: the workspace takes no options"):
        environments.load(load_config(set_pairs=["env.options={users: 3}"]))
