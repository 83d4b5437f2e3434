"""Shared set-up for runtime tests (also imported by the vLLM tests, in their own environment)."""

from __future__ import annotations

from pathlib import Path

from components.core.config import SandboxConfig, TinyModelConfig
from components.core.tiny import build_tiny_model
from components.sandbox import expert
from components.sandbox.recipe import corpus_lines
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import generate_world


def episode_ids(traj) -> tuple[list[int], list[int], list[float]]:
    """An episode's whole token sequence: ids, agent mask, and the sampled logprobs (0.0 off the agent's tokens)."""
    ids, mask, lps = [], [], []
    for t in traj.turns:
        ids += t.tokens or []
        mask += t.mask or []
        lps += t.logprobs if t.role == "assistant" else [0.0] * len(t.tokens or [])
    return ids, mask, lps


def make_sandbox(cfg: SandboxConfig | None = None):
    cfg = cfg or SandboxConfig()
    world = generate_world(cfg)
    return cfg, world, generate_tasks(world, cfg)


def tiny_on_sandbox(out: Path, cfg: SandboxConfig, world, suites, n_demos: int = 60) -> Path:
    """The embedded tiny model, its tokenizer trained on the sandbox's text (as the pipeline builds it)."""
    env = WorkspaceEnv(world, cfg)
    demos = [expert.solve_json(env, t)[0] for t in suites["train"][:n_demos]]
    return build_tiny_model(out, TinyModelConfig(pretrain_steps=0), corpus_lines(world, demos), seed=0)


def sft_inputs(out: Path, cfg, n_demos: int = 16) -> tuple[Path, Path]:
    """(demos directory, base model) for SFT tests: expert demos of the first train tasks, and a tiny base
    of `cfg.model.tiny`'s shape whose tokenizer is trained on their text."""
    from components.core.schema import write_jsonl

    world = generate_world(cfg.sandbox)
    tasks = generate_tasks(world, cfg.sandbox)["train"][:n_demos]
    env = WorkspaceEnv(world, cfg.sandbox)
    demos = [expert.solve_json(env, t)[0] for t in tasks]
    write_jsonl(out / "demos" / "train.jsonl", demos)
    return out / "demos", build_tiny_model(out / "base", cfg.model.tiny, corpus_lines(world, demos), seed=0)


def kill_after_checkpoint(proc, latest, step: int, log: Path, delay_s: float, timeout_s: float = 600) -> None:
    """Wait until `latest()` (the newest complete checkpoint) reaches `step`, wait `delay_s` more so the kill
    lands mid-step, then SIGKILL the process group of `proc` (started with start_new_session=True)."""
    import os
    import signal
    import time

    deadline = time.time() + timeout_s
    while latest() < step:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
