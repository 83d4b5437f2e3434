"""The `prepare` step, top to bottom.

1. Resolve the config (preset <- overrides) and validate it before anything heavy happens.
2. Open the phase run (under the parent run; create the parent when there is none).
3. Bring the base model in: build the embedded tiny model, or resolve a directory, an s3:// prefix, a .gguf
   file or a named model (`core.sources`).
4. Smoke-test it: load it offline through `from_pretrained`, apply the chat template, generate.
5. Write the model and the resolved config to the outputs, store the model under the run's storage
   prefix, log metrics and artifacts.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from components.core import storage
from components.core.config import ModelConfig, PipelineConfig
from components.core.phase import PhaseResult, setup_phase
from components.core.tiny import ensure_tiny_model
from components.core.tracking import PhaseRun

PHASE = "prepare"


def fetch_base_model(cfg: PipelineConfig, home: Path, corpus: str | None = None) -> Path:
    """A local directory holding the base model named by `model.base_uri`.

    'tiny' builds the embedded model, its tokenizer trained on `corpus` (the sandbox's text, one line
    per entry; from sandbox_build) or, without one, on the fallback corpus.
    """
    cfg.check_base_model()
    uri = cfg.model.base_uri
    if uri == "tiny":
        lines = None
        if corpus:
            lines = [x for x in storage.read_text(corpus).splitlines() if x.strip()]
        # one folder per seed: `agentrl learn` over seeds (or runs that alternate seeds) pretrain each base once
        out = home / "models" / f"tiny-base-seed{cfg.run.seed}"
        return ensure_tiny_model(out, cfg.model.tiny, corpus=lines, seed=cfg.run.seed)
    from components.core.policy import resolve_model_dir

    return resolve_model_dir(uri, home / "cache")  # a directory, any s3:// prefix, a .gguf file, a named model


def smoke_test(model_dir: Path, model_cfg: ModelConfig | None = None, max_new_tokens: int = 16) -> dict[str, float]:
    """Load offline like any production model (its chat template checked for agent episodes) and generate."""
    import torch

    from components.core.policy import load_policy
    from components.core.tokens import chat_format

    pol = load_policy(str(model_dir), model_cfg=model_cfg)
    tok, model = pol.tokenizer, pol.model
    fmt = chat_format(tok)
    ids = torch.tensor([fmt.prompt_ids("You are an assistant.", "Move the mails from alice to Finance.")])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    return {
        "base_parameters": float(sum(p.numel() for p in model.parameters())),
        "smoke_new_tokens": float(new),
        "smoke_tokens_per_s": new / max(dt, 1e-9),
        "vocab_size": float(len(tok)),
        "observation_role_tool": float(fmt.obs_role == "tool"),
        "template_system_role": float(fmt.system_role),
    }


def run(
    preset: str = "tiny",
    overrides: str = "",
    base_model_uri: str = "",
    experiment: str = "",
    model_out: str | None = None,
    config_out: str | None = None,
    parent_run_id: str | None = None,
    corpus: str | None = None,
) -> PhaseResult:
    pairs = [f"model.base_uri={base_model_uri}"] if base_model_uri else []
    pairs += [f"tracking.experiment={experiment}"] if experiment else []
    cfg, home, storage_root = setup_phase(preset, overrides, pairs)

    with PhaseRun(PHASE, config=cfg, parent_run_id=parent_run_id or None, close_parent=False) as tracker:
        t0 = time.perf_counter()
        model_dir = fetch_base_model(cfg, home, corpus)
        metrics = {"fetch_seconds": time.perf_counter() - t0}
        metrics.update(smoke_test(model_dir, cfg.model))
        tracker.log_metrics(metrics, step=0)

        model_uri = tracker.storage_uri(storage_root, "base_model")
        storage.put_dir(model_dir, model_uri)
        if model_out:
            shutil.copytree(model_dir, model_out, dirs_exist_ok=True)
        resolved = json.dumps(cfg.to_dict(), indent=1, sort_keys=True)
        if config_out:
            Path(config_out).parent.mkdir(parents=True, exist_ok=True)
            Path(config_out).write_text(resolved)
        cfg_file = home / "runs" / tracker.run_id / "config.json"
        cfg_file.parent.mkdir(parents=True, exist_ok=True)
        cfg_file.write_text(resolved)
        tracker.log_artifact(cfg_file)
        tracker.set_tags({"agentrl.base_model": cfg.model.base_uri, "agentrl.model_uri": model_uri})
        return PhaseResult(tracker.parent_run_id, tracker.run_id, str(model_dir), model_uri, metrics)
