"""The rollout loop against bare batched generation on the same prompts and output lengths, side by side."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from components.core.config import SandboxConfig, TinyModelConfig
from components.core.generation import HFBackend, SamplingParams
from components.core.policy import load_policy
from components.core.rollout import RolloutSettings, rollout
from components.core.tiny import build_tiny_model
from components.core.tokens import ChatFormat
from components.sandbox import expert
from components.sandbox.recipe import corpus_lines
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import generate_world


class Recording:
    """Wraps a backend: remembers every call and the time spent generating."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.seconds = inner, [], 0.0
        self.eos_id = inner.eos_id

    def generate(self, prompts, params, sessions=None):
        t0 = time.perf_counter()
        out = self.inner.generate(prompts, params, sessions)
        self.seconds += time.perf_counter() - t0
        self.calls.append(([list(p) for p in prompts], params))
        return out

    def end_sessions(self, keys=None):
        self.inner.end_sessions(keys)

    def sync(self, model):
        self.inner.sync(model)


def bench_rollout(out: dict, episodes: int = 32, turns: int = 4, new_tokens: int = 24) -> None:
    cfg = SandboxConfig()
    world = generate_world(cfg)
    suites = generate_tasks(world, cfg)
    env = WorkspaceEnv(world, cfg)
    demos = [expert.solve_json(env, t)[0] for t in suites["train"][:60]]
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_tiny_model(Path(d) / "m", TinyModelConfig(pretrain_steps=0), corpus_lines(world, demos), seed=0)
        pol = load_policy(str(model_dir))
        fmt = ChatFormat(pol.tokenizer)
        backend = Recording(HFBackend(pol.model, pol.tokenizer, batch_size=episodes))
        settings = RolloutSettings(max_turns=turns, max_new_tokens=new_tokens, progress=False, max_live=episodes)
        t0 = time.perf_counter()
        trajs = rollout(backend, lambda: WorkspaceEnv(world, cfg), fmt, suites["train"][:episodes], settings)
        loop_s = time.perf_counter() - t0
        tokens = sum(t.generated_tokens for t in trajs)
        bare = HFBackend(pol.model, pol.tokenizer, batch_size=episodes)
        t0 = time.perf_counter()
        replayed = 0
        for prompts, params in backend.calls:
            replayed += sum(len(o.ids) for o in bare.generate(prompts, params))
        bare_s = time.perf_counter() - t0
        first = backend.calls[0][0]
        sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
        t0 = time.perf_counter()
        n_batched = sum(len(o.ids) for o in bare.generate(first, sp))
        batched_s = time.perf_counter() - t0
        one = HFBackend(pol.model, pol.tokenizer, batch_size=1)
        t0 = time.perf_counter()
        n_single = sum(len(o.ids) for o in one.generate(first, sp))
        single_s = time.perf_counter() - t0
    out["rollout.tokens_per_s"] = {"value": round(tokens / loop_s, 1), "unit": "tok/s", "goal": None,
                                   "baseline": round(replayed / bare_s, 1), "ratio": round((tokens / loop_s) / (replayed / bare_s), 3)}
    out["rollout.loop_overhead_pct"] = {"value": round(100 * (loop_s - bare_s) / bare_s, 2), "unit": "%", "goal": 10.0,
                                        "baseline": None, "ratio": None}
    out["rollout.batched_vs_one_by_one"] = {"value": round(n_batched / batched_s, 1), "unit": "tok/s", "goal": None,
                                            "baseline": round(n_single / single_s, 1),
                                            "ratio": round((n_batched / batched_s) / (n_single / single_s), 2)}
