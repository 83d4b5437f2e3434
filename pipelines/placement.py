"""Where each phase runs on the cluster: GPUs, CPU, memory, the H100 node pool, /dev/shm, the model
cache, secrets as env, timeouts and retries — applied to the pipeline's tasks with kfp-kubernetes.

A plan maps phase name -> Placement. Plans: `local` (kfp.local and laptops: nothing applied) and `h100`
(the cluster defaults below). A YAML file overrides any field, for every phase (`defaults:`) or for one
(`phases: {sft: {gpus: 4}}`); the node-pool values match helm/agentrl/values.yaml (`nodePool:`).
The plan is chosen when the pipeline is compiled (`agentrl compile --placement h100 --placement-file f.yaml`;
`pipelines.agent_rl.build(plan)`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

PHASES = ("configure", "sandbox_build", "prepare", "champion", "sft_warmup", "grpo", "rejection_sampling", "dpo", "evaluate",
          "promote", "skip_phase", "finish_run")


@dataclass(frozen=True)
class Placement:
    gpus: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str | None = None  # request (the limit is set equal: guaranteed QoS for training pods)
    memory: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    shm_size: str | None = None  # /dev/shm as a memory-backed emptyDir (NCCL and dataloaders need more than 64 MiB)
    cache_pvc: str | None = None  # a PVC with the model cache, mounted at cache_mount
    cache_mount: str = "/cache"
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # secret name -> {key: ENV_NAME}
    # ConfigMap name -> {key: ENV_NAME}, mounted optional (a key the chart did not render is simply unset)
    config_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    timeout_s: int | None = None
    retries: int = 0
    retry_backoff_s: int = 60  # the wait before the first retry (doubled before each next)
    image: str | None = None  # 'trainer', 'rollout' (vLLM), 'sandbox' or a full image reference; None = the component's
    # KFP's cache: on only for a task whose outputs are a pure function of its inputs and that writes nowhere else
    cache: bool = False


_GPU_POOL = {"node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
             "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
# S3 credentials from a Secret (helm: s3.existingSecret); the MLflow URI comes from the KFP MLflow plugin
# or the config, so it is no secret by default — add more secrets per phase in a placement file.
_SECRETS = {"agentrl-s3": {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"}}
# where MLflow and the store are, from the chart's ConfigMap (helm/agentrl/templates/platform.yaml)
_PLATFORM = {"agentrl-platform": {k: k for k in ("MLFLOW_TRACKING_URI", "AGENTRL_STORAGE_ROOT", "AWS_ENDPOINT_URL")}}
_TRAIN = dict(_GPU_POOL, gpus=8, cpu="96", memory="1500Gi", shm_size="256Gi", cache_pvc="agentrl-model-cache",
              retries=3)
_ONE_GPU = dict(_GPU_POOL, gpus=1, cpu="16", memory="200Gi", shm_size="32Gi", cache_pvc="agentrl-model-cache",
                retries=3)
# the phases that generate (the h100 preset sets generation.backend=vllm) run in the image that has vLLM
_ROLLOUT = {"image": "rollout"}
GENERATING = ("grpo", "rejection_sampling", "dpo", "evaluate")  # the phases that run in the rollout image
# kfp.local honours a task's retry policy too: a phase process that dies (a crash, an OOM kill) is started once more
# and resumes from what its first attempt staged, as on the cluster; `configure` is not retried (its errors are the
# run form's, the same on every attempt)
_RETRIED = tuple(ph for ph in PHASES if ph != "configure")
_LOCAL_RETRY = {"retries": 1, "retry_backoff_s": 1}

PLANS: dict[str, dict[str, dict[str, Any]]] = {
    "local": {"configure": {"cache": True}, **{ph: dict(_LOCAL_RETRY) for ph in _RETRIED}},
    # `agentrl run --runner docker`: each task in the image the cluster gives it (kfp.local ignores resources)
    "containers": {"configure": {"cache": True},
                   **{ph: dict(_LOCAL_RETRY, **(_ROLLOUT if ph in GENERATING else {})) for ph in _RETRIED}},
    "h100": {
        "defaults": {"secrets": _SECRETS, "config_maps": _PLATFORM},
        "configure": {"cpu": "1", "memory": "2Gi", "timeout_s": 600, "retries": 2, "cache": True},
        "sandbox_build": {"cpu": "8", "memory": "32Gi", "timeout_s": 3600, "retries": 2},
        "prepare": {"cpu": "8", "memory": "64Gi", "cache_pvc": "agentrl-model-cache", "timeout_s": 7200, "retries": 2},
        "sft_warmup": dict(_TRAIN, timeout_s=24 * 3600),
        "grpo": dict(_TRAIN, **_ROLLOUT, timeout_s=72 * 3600),
        # one process each (best-of-N and DPO fine-tune in-process): one GPU, not the pod's eight
        "rejection_sampling": dict(_ONE_GPU, **_ROLLOUT, timeout_s=24 * 3600),
        "dpo": dict(_ONE_GPU, **_ROLLOUT, timeout_s=24 * 3600),
        "evaluate": dict(_GPU_POOL, **_ROLLOUT, gpus=1, cpu="16", memory="200Gi", shm_size="32Gi", cache_pvc="agentrl-model-cache",
                         timeout_s=6 * 3600, retries=2),
        "champion": {"cpu": "2", "memory": "16Gi", "cache_pvc": "agentrl-model-cache", "timeout_s": 3600, "retries": 3},
        "promote": {"cpu": "1", "memory": "2Gi", "timeout_s": 600, "retries": 3},
        "finish_run": {"cpu": "1", "memory": "2Gi", "timeout_s": 600, "retries": 3},
        # a switched-off phase hands its input model on (a copy through the pipeline root)
        "skip_phase": {"cpu": "2", "memory": "8Gi", "timeout_s": 3 * 3600, "retries": 2},
    },
}


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _placement(values: dict[str, Any], where: str) -> Placement:
    known = {f.name for f in fields(Placement)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"placement {where}: unknown field(s) {unknown}; expected some of {sorted(known)}")
    p = Placement(**values)
    if p.gpus < 0 or p.retries < 0 or p.retry_backoff_s < 0 or (p.timeout_s is not None and p.timeout_s <= 0):
        raise ValueError(f"placement {where}: gpus, retries, retry_backoff_s must be >= 0 and timeout_s > 0 (got {asdict(p)})")
    return p


def load_plan(name: str = "local", file: str | Path | None = None) -> dict[str, Placement]:
    """The plan `name`, with the YAML `file` (keys `defaults` and `phases`) on top."""
    import yaml

    if name not in PLANS:
        raise ValueError(f"placement plan {name!r}: expected one of {sorted(PLANS)}")
    plan = copy.deepcopy(PLANS[name])
    if file:
        data = yaml.safe_load(Path(file).read_text()) or {}
        if not isinstance(data, dict) or set(data) - {"defaults", "phases"}:
            raise ValueError(f"{file}: expected a mapping with 'defaults' and/or 'phases'")
        unknown = sorted(set(data.get("phases") or {}) - set(PHASES))
        if unknown:
            raise ValueError(f"{file}: unknown phase(s) {unknown}; expected some of {list(PHASES)}")
        plan["defaults"] = _merge(plan.get("defaults", {}), data.get("defaults") or {})
        for phase, values in (data.get("phases") or {}).items():
            plan[phase] = _merge(plan.get(phase, {}), values)
    defaults = plan.get("defaults", {})
    return {ph: _placement(_merge(defaults, plan.get(ph, {})), f"{name}/{ph}") for ph in PHASES}


def fit_gpus(plan: dict[str, Placement], cfg: Any) -> dict[str, Placement]:
    """Each phase asks for the GPUs it uses with the compile preset `cfg`: GRPO with vLLM is one process whose
    engine spans `generation.vllm.tensor_parallel_size` GPUs (torchrun over every GPU is the `hf` backend's)."""
    out = dict(plan)
    grpo = plan["grpo"]
    if cfg.generation.backend == "vllm" and grpo.gpus > cfg.generation.vllm.tensor_parallel_size:
        out["grpo"] = replace(grpo, gpus=cfg.generation.vllm.tensor_parallel_size)
    return out


def apply(task: Any, p: Placement) -> Any:
    """Put `p` on a pipeline task (resources with the KFP SDK, the rest with kfp-kubernetes)."""
    from kfp import kubernetes

    if p.image:
        from components.core import images

        named = {"trainer": images.TRAINER, "rollout": images.ROLLOUT, "sandbox": images.SANDBOX}
        task.container_spec.image = named.get(p.image, p.image)
    if p.cpu:
        task.set_cpu_request(p.cpu).set_cpu_limit(p.cpu)
    if p.memory:
        task.set_memory_request(p.memory).set_memory_limit(p.memory)
    if p.gpus:
        task.set_accelerator_type(p.gpu_resource).set_accelerator_limit(p.gpus)
    for key, value in sorted(p.node_selector.items()):
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for tol in p.tolerations:
        kubernetes.add_toleration(task, **tol)
    if p.shm_size:
        kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                                   size_limit=p.shm_size)
    if p.cache_pvc:
        kubernetes.mount_pvc(task, pvc_name=p.cache_pvc, mount_path=p.cache_mount)
        task.set_env_variable("HF_HOME", f"{p.cache_mount}/hf")
    for secret, mapping in sorted(p.secrets.items()):
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=dict(mapping))
    for name, mapping in sorted(p.config_maps.items()):
        kubernetes.use_config_map_as_env(task, config_map_name=name, config_map_key_to_env=dict(mapping), optional=True)
    if p.timeout_s:
        kubernetes.set_timeout(task, p.timeout_s)
    task.set_caching_options(p.cache)
    if p.retries:
        task.set_retry(num_retries=p.retries, backoff_duration=f"{p.retry_backoff_s}s", backoff_factor=2.0)
    return task


def placer(plan: dict[str, Placement], cache: bool = True):
    """`place(task, phase)` for a pipeline body: names the task after its phase and applies the plan.
    `cache=False`: no task of this pipeline is served from KFP's cache, whatever the plan says."""
    def place(task: Any, phase: str) -> Any:
        task.set_display_name(phase)
        p = plan[phase]
        return apply(task, p if cache or not p.cache else replace(p, cache=False))

    return place
