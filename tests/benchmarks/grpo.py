"""The GRPO update against TRL's GRPOTrainer: trained tokens/s on the same tiny model, prompts, batch and
group size, single-turn, side by side in one run. Generation is timed apart and left out on both sides:
what is compared is the update (log-probs, loss, backward, optimizer step)."""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from components.core.config import GRPOConfig as OurConfig
from components.core.config import SandboxConfig, TinyModelConfig
from components.core.generation import HFBackend, SamplingParams
from components.core.policy import load_policy
from components.core.tiny import build_tiny_model
from components.core.tokens import ChatFormat
from components.grpo.loss import Sample
from components.grpo.monitor import control_token_ids
from components.grpo.recipe import update
from components.sandbox import expert
from components.sandbox.recipe import corpus_lines
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import generate_world

SYSTEM = "You are the user's assistant in a workspace with mail, files, calendar and chat."


def _trl_update_rate(model_dir: Path, prompts: list[str], group: int, micro: int, completion: int, steps: int,
                     work: str) -> tuple[float, float]:
    """TRL: (trained completion tokens, seconds of update) over `steps` optimizer steps after a warm-up one."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    pol = load_policy(str(model_dir), trainable=True)
    ds = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}]}
                            for p in prompts] * (steps + 2))
    args = GRPOConfig(output_dir=work, use_cpu=True, per_device_train_batch_size=micro,
                      gradient_accumulation_steps=len(prompts) * group // micro, num_generations=group,
                      max_completion_length=completion, max_steps=steps + 1, learning_rate=1e-5, beta=0.0,
                      logging_steps=1, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                      shuffle_dataset=False, dataloader_num_workers=0)
    rng = random.Random(0)
    trainer = GRPOTrainer(model=pol.model, reward_funcs=[lambda completions, **kw: [rng.random() for _ in completions]],
                          args=args, train_dataset=ds, processing_class=pol.tokenizer)
    gen = {"s": 0.0, "tokens": 0.0, "step": []}
    inner = trainer._generate_and_score_completions

    def timed(inputs):
        t0 = time.perf_counter()
        out = inner(inputs)
        gen["s"] += time.perf_counter() - t0
        gen["step"].append((trainer.state.global_step, time.perf_counter() - t0, float(out["completion_mask"].sum())))
        return out

    trainer._generate_and_score_completions = timed
    spans: list[tuple[int, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            spans.append((state.global_step, time.perf_counter() - self.t0))

    trainer.add_callback(Clock())
    trainer.train()
    # step k (1-based, after its end) contains the generation calls made while global_step was k-1
    total = sum(s for k, s in spans if k > 1)
    gen_s = sum(s for k, s, _ in gen["step"] if k >= 1)
    tokens = sum(n for k, _, n in gen["step"] if k >= 1)
    return tokens, total - gen_s


def _our_update_rate(model_dir: Path, prompts: list[str], group: int, micro: int, completion: int,
                     steps: int) -> tuple[float, float]:
    import torch
    from accelerate import Accelerator
    from transformers import get_constant_schedule

    pol = load_policy(str(model_dir), trainable=True)
    fmt = ChatFormat(pol.tokenizer)
    backend = HFBackend(pol.model, pol.tokenizer, batch_size=len(prompts) * group)
    g = OurConfig(tasks_per_step=len(prompts), group_size=group, micro_batch_size=micro, beta=0.0,
                  learning_rate=1e-5)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=len(prompts) * group // micro)
    opt = torch.optim.AdamW(pol.model.parameters(), lr=g.learning_rate)
    model, opt, sched = acc.prepare(pol.model, opt, get_constant_schedule(opt))
    ids = [fmt.prompt_ids(SYSTEM, p) for p in prompts for _ in range(group)]
    rng = random.Random(0)
    tokens, seconds = 0.0, 0.0
    for step in range(steps + 1):
        outs = backend.generate(ids, SamplingParams(1.0, 1.0, completion, seed=step))
        batch = [Sample(p + o.ids, [0] * len(p) + [1] * len(o.ids), [0.0] * len(p) + [a] * len(o.ids))
                 for p, o in zip(ids, outs, strict=True) for a in [rng.gauss(0, 1)]]
        model.train()
        t0 = time.perf_counter()
        st = update(model, None, opt, sched, acc, batch, g, pol.tokenizer.pad_token_id,
                    control_token_ids(pol.tokenizer, "json"))
        if step:  # the first is a warm-up
            seconds += time.perf_counter() - t0
            tokens += st["tokens"]
    return tokens, seconds


def bench_grpo(out: dict, prompts: int = 8, group: int = 4, micro: int = 8, completion: int = 32, steps: int = 4) -> None:
    cfg = SandboxConfig()
    world = generate_world(cfg)
    suites = generate_tasks(world, cfg)
    env = WorkspaceEnv(world, cfg)
    demos = [expert.solve_json(env, t)[0] for t in suites["train"][:60]]
    texts = [t.instruction for t in suites["train"][::37][:prompts]]
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_tiny_model(Path(d) / "m", TinyModelConfig(pretrain_steps=0), corpus_lines(world, demos), seed=0)
        trl_tokens, trl_s = _trl_update_rate(model_dir, texts, group, micro, completion, steps, str(Path(d) / "trl"))
        our_tokens, our_s = _our_update_rate(model_dir, texts, group, micro, completion, steps)
    ours, theirs = our_tokens / our_s, trl_tokens / trl_s
    out["grpo.update_tokens_per_s"] = {"value": round(ours, 1), "unit": "trained tok/s", "goal": None,
                                       "baseline": round(theirs, 1), "ratio": None}
    out["grpo.throughput_vs_trl"] = {"value": round(ours / theirs, 3), "unit": "x TRL GRPOTrainer", "goal": 1.2,
                                     "baseline": 1.0, "ratio": round(ours / theirs, 3)}
