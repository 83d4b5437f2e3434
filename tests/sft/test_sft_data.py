from __future__ import annotations

import pytest

from components.core import env as environments
from components.core.config import SandboxConfig, SFTConfig, TinyModelConfig, load_config
from components.core.policy import load_policy
from components.core.recovery import mistakes
from components.core.tiny import build_tiny_model
from components.core.tokens import demo_example
from components.core.training import build_dataset, train_sft
from components.sandbox import expert
from components.sandbox.recipe import corpus_lines
from components.sandbox.tasks import generate_tasks
from components.sandbox.workspace import WorkspaceEnv
from components.sandbox.world import generate_world
from components.sft.errors import error_examples


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = SandboxConfig()
    world = generate_world(cfg)
    suites = generate_tasks(world, cfg)
    env = WorkspaceEnv(world, cfg)
    demos = [expert.solve_json(env, t)[0] for t in suites["train"][:30]]
    model = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny",
                             TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, pretrain_steps=0),
                             corpus_lines(world, demos), seed=0)
    return world, suites, demos, model


def test_loss_falls_only_on_the_agents_tokens(setup, tmp_path):
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer

    _, _, demos, model = setup
    pol = load_policy(str(model), trainable=True)
    ex = [demo_example(d) for d in demos[:4]]
    # the phase's own dataset (masks from the template's incremental rendering) through TRL's label building
    trainer = SFTTrainer(model=pol.model, processing_class=pol.tokenizer, train_dataset=build_dataset(ex, 0, pol.tokenizer),
                         args=TRLConfig(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none",
                                        max_length=4096))
    tok = pol.tokenizer
    order = {d.turns[1].text: d for d in demos[:4]}
    for row in trainer.train_dataset:
        demo = next(d for text, d in order.items() if text in tok.decode(row["input_ids"]))
        ids, labels = row["input_ids"], row["labels"]
        trained = tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != -100])
        expected = "".join(t.text + tok.eos_token for t in demo.turns if t.role == "assistant")
        assert trained == expected
        assert demo.turns[0].text[:30] not in trained and demo.turns[3].text[:20] not in trained  # system, observation


def test_error_examples_put_the_mistake_in_the_prompt(setup):
    import random

    world, suites, demos, _ = setup
    cfg = load_config()
    first = next(t.text for t in demos[0].turns if t.role == "assistant")
    wrong = {mistakes(first, random.Random(s)) for s in range(10)}
    assert first not in wrong and len(wrong) >= 2
    exs = error_examples(demos, environments.load(cfg), cfg.run.seed)
    assert len(exs) >= len(demos) // 2
    for ex in exs:
        assert [m["role"] for m in ex["prompt"]] == ["system", "user", "assistant", "tool"]
        assert '"ok":false' in ex["prompt"][3]["content"]
        assert ex["completion"][0]["role"] == "assistant"


def test_train_sft_reduces_loss_and_respects_the_budget(setup, tmp_path):
    _, _, demos, model = setup
    pol = load_policy(str(model), trainable=True)
    stats = train_sft(pol, [demo_example(d) for d in demos], SFTConfig(epochs=2, batch_size=4, learning_rate=3e-3,
                                                                        logging_steps=1, max_minutes=None),
                      tmp_path / "t", seed=0)
    assert stats["train_steps"] == 16 and stats["train_loss"] < 7.0
    pol2 = load_policy(str(model), trainable=True)
    stats2 = train_sft(pol2, [demo_example(d) for d in demos], SFTConfig(epochs=50, batch_size=4, max_minutes=0.05),
                       tmp_path / "t2", seed=0)
    assert stats2["train_steps"] < 50 * 8 and stats2["train_seconds"] < 60
