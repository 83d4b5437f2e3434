from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.core.config import TinyModelConfig
from components.core.tiny import CHAT_TEMPLATE, build_tiny_model, ensure_tiny_model, fallback_corpus

SMALL = TinyModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, max_position_embeddings=256, pretrain_steps=0)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinyModelConfig(pretrain_steps=0), seed=0)


def test_default_model_size_and_card(tiny):
    card = json.loads((tiny / "agentrl.json").read_text())
    assert card["schema"] == "agentrl/model/v1" and card["phase"] == "tiny"
    assert 2_000_000 < card["extra"]["parameters"] < 10_000_000  # "a few million"
    assert "{% generation %}" in (tiny / "chat_template.jinja").read_text()


def test_reloads_offline_in_a_fresh_process(tiny):
    code = (
        "import os, torch; from transformers import AutoModelForCausalLM, AutoTokenizer;"
        f"p={str(tiny)!r}; tok=AutoTokenizer.from_pretrained(p); m=AutoModelForCausalLM.from_pretrained(p);"
        "ids=tok.apply_chat_template([{'role':'user','content':'Move the mails'}], add_generation_prompt=True,"
        " return_tensors='pt', return_dict=True)['input_ids'];"
        "out=m.generate(ids, max_new_tokens=5, do_sample=False); print(out.shape[1] > ids.shape[1])"
    )
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tiny.parent)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("True")


def test_assistant_mask_covers_exactly_the_agent_turns(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    msgs = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Move the budget mails"},
        {"role": "assistant", "content": '{"tool": "mail.search"}'},
        {"role": "tool", "content": '{"status": 200}'},
        {"role": "assistant", "content": "done"},
    ]
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tok.decode([i for i, m in zip(ids, mask, strict=False) if m]) == '{"tool": "mail.search"}<|end|>done<|end|>'
    assert tok.decode([i for i, m in zip(ids, mask, strict=False) if not m]).count("<|end|>") == 3
    for special in ("<|end|>", "<|assistant|>", "<|tool|>", "<|pad|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|end|>" and tok.padding_side == "left"
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_deterministic_for_a_seed(tmp_path):
    a = build_tiny_model(tmp_path / "a", SMALL, seed=7)
    b = build_tiny_model(tmp_path / "b", SMALL, seed=7)
    c = build_tiny_model(tmp_path / "c", SMALL, seed=8)
    for name in ("model.safetensors", "tokenizer.json"):
        assert digest(a / name) == digest(b / name)
    assert digest(a / "model.safetensors") != digest(c / "model.safetensors")


def test_tokenizer_learns_the_given_corpus(tmp_path):
    corpus = ["zebra quokka " * 20] * 50 + fallback_corpus(0, 50)
    m = build_tiny_model(tmp_path / "m", SMALL, corpus=corpus, seed=0)
    vocab = json.loads((m / "tokenizer.json").read_text())["model"]["vocab"]
    assert any("quokka" in t for t in vocab)


def test_ensure_rebuilds_only_when_inputs_change(tmp_path):
    p = ensure_tiny_model(tmp_path / "m", SMALL, seed=0)
    before = (p / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(tmp_path / "m", SMALL, seed=0)
    assert (p / "model.safetensors").stat().st_mtime_ns == before
    ensure_tiny_model(tmp_path / "m", SMALL, seed=1)
    assert json.loads((p / "agentrl.json").read_text())["extra"]["seed"] == 1


def test_empty_corpus_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="corpus is empty"):
        build_tiny_model(tmp_path / "m", SMALL, corpus=[], seed=0)


def test_template_constant_matches_saved(tiny):
    assert (tiny / "chat_template.jinja").read_text().strip() == CHAT_TEMPLATE.strip()


def test_digits_are_one_token_each(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    pieces = [tok.decode([i]) for i in tok("Move m230 to day 14", add_special_tokens=False)["input_ids"]]
    assert [p for p in pieces if p.strip().isdigit()] == ["2", "3", "0", "1", "4"]
    assert tok.decode(tok("m230 14", add_special_tokens=False)["input_ids"]) == "m230 14"


def test_copy_sequences_repeat_a_span_and_label_only_the_repeat(tiny):
    from transformers import AutoTokenizer

    from components.core.tiny import CopySequences

    cfg = TinyModelConfig(pretrain_span=6, pretrain_gap=5)
    tok = AutoTokenizer.from_pretrained(tiny)
    a, b = CopySequences(tok, cfg, seed=3), CopySequences(tok, cfg, seed=3)
    ids, labels = a.batch(8)
    assert ids.shape == labels.shape == (8, 6 + 1 + 5 + 6)
    assert (ids == b.batch(8)[0]).all()  # seeded
    span = ids[:, -6:]
    for row in range(8):  # the span occurs before the separator, somewhere in the first part
        first = ids[row, :-6].tolist()
        sep = first.index(tok.convert_tokens_to_ids("<|end|>"))
        assert first[sep - 6:sep] == span[row].tolist()
    assert (labels[:, :-5] == -100).all() and (labels[:, -5:] == ids[:, -5:]).all()
    assert not set(ids.flatten().tolist()) & (set(tok.all_special_ids) - {tok.convert_tokens_to_ids("<|end|>")})


def test_reach_curriculum_grows_the_gap_after_the_copy_forms_and_draws_digit_rows(tiny):
    from transformers import AutoTokenizer

    from components.core.tiny import CopySequences

    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = TinyModelConfig(pretrain_span=6, pretrain_gap=8, pretrain_reach=64, pretrain_digit_rows=0.5)
    data = CopySequences(tok, cfg, seed=0)
    assert data.schedule(30, 90) == (8, 0.0)  # the first third: the short copy only
    mid, share = data.schedule(48, 90)
    assert 8 < mid < 64 and share == 0.5
    assert data.schedule(67, 90) == data.schedule(90, 90) == (64, 0.5)
    ids, labels = data.batch(4, 64, digit_rows=0.5, exact=True)
    assert ids.shape == (4, 6 + 1 + 64 + 6)
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    assert set(ids[:2].flatten().tolist()) <= digits | {data.sep}  # half the rows in the ten digits only
    assert not set(ids[2:].flatten().tolist()) <= digits | {data.sep}
    for row in ids:  # exact: the span sits right before the separator, the gap is 64 tokens
        assert row[:6].tolist() == row[-6:].tolist() and row[6] == data.sep
    off = CopySequences(tok, TinyModelConfig(pretrain_gap=8, pretrain_reach=0), seed=0)
    assert off.schedule(90, 90) == (8, 0.0)  # reach <= gap: the short copy throughout


def test_prepare_keeps_one_base_per_seed(tmp_path):
    """`agentrl learn` over seeds pretrains each seed's base once: going back to a seed reuses its folder."""
    from components.core.config import load_config
    from components.prepare.recipe import fetch_base_model

    def base(seed: int) -> Path:
        cfg = load_config(preset="tiny", set_pairs=[f"run.seed={seed}"])
        cfg.model.tiny = SMALL
        return fetch_base_model(cfg, tmp_path)

    first = base(0)
    built = (first / "model.safetensors").stat().st_mtime_ns
    second = base(1)
    assert second != first and json.loads((second / "agentrl.json").read_text())["extra"]["seed"] == 1
    assert base(0) == first and (first / "model.safetensors").stat().st_mtime_ns == built
    assert json.loads((first / "agentrl.json").read_text())["extra"]["seed"] == 0
