"""GPU checks (run on a CUDA machine, not collected by pytest): the phases' CUDA paths for real.

    python -m tests.gpu.checks OUT_DIR

1. sandbox_build + prepare (the tiny model), then SFT on CUDA with the h100 preset's training settings:
   bf16, gradient checkpointing, DeepSpeed ZeRO-3 (one process per GPU under torchrun when there are several).
2. GRPO on CUDA from that model: bf16, HF generation on the GPU; then again under DeepSpeed ZeRO-3 (shards
   gathered for generation, weights gathered to save); then a restart that resumes from the last checkpoint.
Each result (or the error) goes to OUT_DIR/gpu_checks.json as soon as it is known.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def main(out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    home = Path(os.environ.get("AGENTRL_HOME", "/tmp/agentrl-gpu"))
    os.environ["AGENTRL_HOME"] = str(home)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    results: dict = {}

    def record(name, fn):
        t0 = time.perf_counter()
        try:
            results[name] = {"ok": True, **fn(), "seconds": round(time.perf_counter() - t0, 1)}
        except Exception as exc:  # noqa: BLE001 - every check reports, the next one still runs
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                             "trace": traceback.format_exc()[-4000:], "seconds": round(time.perf_counter() - t0, 1)}
        (out / "gpu_checks.json").write_text(json.dumps(results, indent=1))
        print(name, json.dumps(results[name])[:1500], flush=True)

    import torch

    results["device"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    from components.prepare.recipe import run as prepare
    from components.sandbox.recipe import run as sandbox_build

    sb = sandbox_build(out_dir=str(home / "sandbox"))
    prepare(model_out=str(home / "base"), parent_run_id=sb.parent_run_id)
    device = os.environ.get("AGENTRL_CHECK_DEVICE", "cuda")  # "cpu": a dry run of this script where there is no GPU
    quick = device == "cpu"
    common = {"run": {"device": device}, "sandbox": {"suite_sizes": {"easy": 16, "hard": 16}},
              "generation": {"batch_size": 128}}
    if quick:
        common["sandbox"].update({"max_turns": 3, "suite_sizes": {"easy": 2, "hard": 2}})

    def phase(module: str, name: str, kwargs: dict):
        """One phase as its own process (as in a KFP task): `python -m components.<phase> --args ... --result ...`."""
        import subprocess

        result = home / f"{name}.result.json"
        log = out / f"{name}.log"
        with log.open("w") as f:
            rc = subprocess.run([sys.executable, "-m", module, "--args", json.dumps(kwargs), "--result", str(result)],
                                stdout=f, stderr=subprocess.STDOUT).returncode
        if rc:
            raise RuntimeError(f"{module} exited {rc}: " + log.read_text()[-1500:])
        return json.loads(result.read_text())

    def sft():
        ov = {**common, "sft": {"bf16": not quick, "gradient_checkpointing": True, "deepspeed": "zero3",
                                "max_minutes": 0.2 if quick else 1.0, "batch_size": 8, "eval_suites": ["easy"],
                                "torch_threads": None}}
        r = phase("components.sft", "sft", dict(overrides=json.dumps(ov), base_model=str(home / "base"),
                                              demos=str(home / "sandbox" / "demos"), tasks_dir=str(home / "sandbox" / "tasks"),
                                              parent_run_id=sb.parent_run_id, model_out=str(home / "sft")))
        return {k: r["metrics"][k] for k in ("train_steps", "train_seconds", "deepspeed", "easy/tgc",
                                             "easy/valid_action_rate") if k in r["metrics"]}

    small = os.environ.get("AGENTRL_CHECK_SMALL") == "1"  # GRPO only, small batches: a short second run
    if small:
        common["sandbox"].update({"max_turns": 4})
    else:
        record("sft_bf16_zero3", sft)
    start = str(home / "sft") if (home / "sft" / "agentrl.json").exists() else str(home / "base")

    def grpo(name, extra):
        def go():
            g = {"steps": 4, "tasks_per_step": 16, "group_size": 8, "micro_batch_size": 16, "eval_every": 2,
                 "eval_max_tasks": 8, "checkpoint_every": 2, "bf16": not quick, "torch_threads": None,
                 "learning_rate": 1e-5, **extra}
            if quick:
                g.update(steps=2, tasks_per_step=2, group_size=2, micro_batch_size=2, eval_every=1, eval_max_tasks=2)
            elif small:
                g.update(steps=2, tasks_per_step=4, group_size=4, micro_batch_size=16, eval_every=1, eval_max_tasks=4,
                         checkpoint_every=1)
            ov = {**common, "grpo": g}
            r = phase("components.grpo", name, dict(
                overrides=json.dumps(ov), policy_model=start, world=str(home / "sandbox" / "world.json"),
                tasks_dir=str(home / "sandbox" / "tasks"), parent_run_id=sb.parent_run_id,
                model_out=str(home / name), checkpoint_uri=str(home / f"ckpt-{name.split('.')[0]}")))
            keep = ("step_seconds", "trained_tokens", "reward_mean", "success_rate", "monitor/kl", "grad_norm",
                    "heldout/easy/tgc", "heldout/hard/tgc")
            return {"steps_done": r["steps_done"], "resumed_from": r["resumed_from"],
                    "saved": (Path(r["model_dir"]) / "model.safetensors").exists(),
                    **{k: r["metrics"].get(k) for k in keep}}
        return go

    record("grpo_cuda_bf16", grpo("grpo", {}))
    record("grpo_cuda_resume_finished", grpo("grpo.again", {}))  # same checkpoints: nothing left to redo
    record("grpo_cuda_zero3", grpo("grpo-z3", {"deepspeed": "zero3"}))
    if torch.cuda.is_available():
        results["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    (out / "gpu_checks.json").write_text(json.dumps(results, indent=1))
    return 0 if all(v.get("ok", True) for v in results.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-out"))
