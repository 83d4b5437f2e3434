"""Policies: load a model from a local directory or an s3:// URI (verified, cached), full weights or a PEFT
LoRA adapter on its base; add a LoRA adapter; merge; save with `agentrl.json`.

Loading goes through `from_pretrained` exactly as for any Hugging Face model, offline: production
models come from a path or S3, never from a hub at run time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.core import storage
from components.core.config import LoraConfig
from components.core.schema import ModelCard, from_record, to_record

__all__ = ["ModelLoadError", "Policy", "load_policy", "resolve_model_dir", "save_policy", "add_lora", "read_card"]


class ModelLoadError(RuntimeError):
    pass


@dataclass
class Policy:
    model: Any  # a transformers PreTrainedModel, or a peft PeftModel
    tokenizer: Any
    source: str  # where it was loaded from
    card: ModelCard | None = None

    @property
    def is_lora(self) -> bool:
        return hasattr(self.model, "peft_config")


def resolve_model_dir(uri: str, cache: str | os.PathLike | None = None) -> Path:
    """A local directory for `uri` (a path, or s3:// downloaded, checked against its manifest, and cached)."""
    if storage.is_s3(uri):
        try:
            return storage.localize_dir(uri, cache)
        except storage.IncompleteDirectoryError as exc:
            raise ModelLoadError(f"{uri}: {exc}") from None
    path = Path(uri)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {uri!r} does not exist")
    return path


def read_card(path: str | os.PathLike) -> ModelCard | None:
    card = Path(path) / "agentrl.json"
    if not card.is_file():
        return None
    return from_record(ModelCard, json.loads(card.read_text()))


def check_tokenizer(tokenizer: Any, where: str) -> None:
    """Agent-token masks need a chat template that marks the assistant's turns."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ModelLoadError(f"{where}: the tokenizer has no chat template")
    if "{% generation %}" not in template and "{%- generation %}" not in template:
        raise ModelLoadError(
            f"{where}: the chat template does not mark assistant turns with {{% generation %}}; agent-token "
            "masks and TRL's assistant-only loss need it (add it around the assistant content)"
        )
    if tokenizer.pad_token_id is None:
        raise ModelLoadError(f"{where}: the tokenizer has no pad token")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not has_tok:
        raise ModelLoadError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any failure here is a broken tokenizer directory
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None
    check_tokenizer(tok, str(path))
    return tok


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_policy(uri: str, dtype: str = "float32", device: str = "cpu", cache: str | os.PathLike | None = None,
                trainable: bool = False) -> Policy:
    """Load full weights, or a LoRA adapter directory (adapter_config.json) on the base it names."""
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
        tokenizer = load_tokenizer(tok_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=_dtype(dtype))
        model = PeftModel.from_pretrained(base, path, is_trainable=trainable)
    else:
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: no config.json — not a Hugging Face model directory")
        tokenizer = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(dtype))
    model.to(device)
    if not trainable:
        model.eval()
    return Policy(model, tokenizer, str(uri), card)


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
    return Policy(get_peft_model(policy.model, peft_cfg), policy.tokenizer, policy.source, policy.card)


def merged(policy: Policy) -> Policy:
    """Fold a LoRA adapter into the base weights (a plain model afterwards)."""
    if not policy.is_lora:
        return policy
    return Policy(policy.model.merge_and_unload(), policy.tokenizer, policy.source, policy.card)


def save_policy(policy: Policy, out: str | os.PathLike, card: ModelCard, merge: bool = False,
                state_dict: dict | None = None) -> Path:
    """Save model (or adapter) + tokenizer + agentrl.json into `out`, replaced whole (atomic rename).

    `state_dict`: the full weights when the module's own are sharded (DeepSpeed ZeRO-3 gathers them)."""
    out = Path(out)
    pol = merged(policy) if merge else policy
    with storage.staged_dir(out) as staging:
        pol.model.save_pretrained(staging, **({"state_dict": state_dict} if state_dict is not None else {}))
        pol.tokenizer.save_pretrained(staging)
        card.kind = "lora" if pol.is_lora else "full"
        (staging / "agentrl.json").write_text(json.dumps(to_record(card), indent=1))
    return out
