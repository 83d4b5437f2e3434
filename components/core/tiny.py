"""The embedded default base model, built locally (no model hub).

A byte-level BPE tokenizer trained on a text corpus (the sandbox's own text, passed in by the
sandbox build; `fallback_corpus()` otherwise), digits split one per token, with a chat template that
marks the assistant's turns with `{% generation %}` (TRL's assistant-only loss and our masks rely on
it), and a small Llama-style model initialised from a seed, then briefly pretrained to copy from its
context (`pretrain`, synthetic random-token sequences only) as any real base LLM can. The result is an
ordinary Hugging Face directory plus `agentrl.json`, loaded offline by the same `from_pretrained` path
as a production model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Iterable
from pathlib import Path

from components.core.config import TinyModelConfig
from components.core.schema import ModelCard, to_record
from components.core.storage import staged_dir

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "build_tokenizer",
    "ensure_tiny_model",
    "fallback_corpus",
    "set_torch_threads",
]

ROLES = ("system", "user", "assistant", "tool")
END = "<|end|>"
PAD = "<|pad|>"
BOS = "<|bos|>"
SPECIAL_TOKENS = [PAD, BOS, END] + [f"<|{r}|>" for r in ROLES]

# Newlines after block tags are written as {{ '\n' }}: transformers trims a bare newline there.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' }}{{ '\\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] }}{{ '<|end|>' }}{% endgeneration %}"
    "{%- else -%}"
    "{{ message['content'] }}{{ '<|end|>' }}"
    "{%- endif -%}"
    "{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{{ '\\n' }}{%- endif -%}"
)


def set_torch_threads(n: int | None = None) -> int:
    """One intra-op thread by default on CPU: two ran 5-10x slower whenever the other core was busy."""
    import torch

    n = int(n or os.environ.get("AGENTRL_TORCH_THREADS", "1"))
    torch.set_num_threads(n)
    return n


def fallback_corpus(seed: int = 0, n: int = 2000) -> list[str]:
    """Agent-shaped text (chat headers, JSON tool calls, workspace words) for when no corpus is given."""
    rng = random.Random(seed)
    people = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
    topics = ["budget", "report", "meeting", "launch", "review", "invoice", "hiring", "roadmap"]
    tools = ["mail.search", "mail.move", "mail.send", "files.read", "files.write", "calendar.create",
             "calendar.list", "chat.post", "chat.read", "finish"]
    out = []
    for _ in range(n):
        p, t, tool = rng.choice(people), rng.choice(topics), rng.choice(tools)
        num = rng.randint(1, 999)
        out.append(f"<|user|>\nMove the emails from {p} about the {t} to the folder {t.title()}.<|end|>")
        out.append(
            f'<|assistant|>\nThought: I should call {tool}.\n'
            f'{{"tool": "{tool}", "args": {{"query": "from:{p} {t}", "id": "m{num}"}}}}<|end|>'
        )
        out.append(f'<|tool|>\n{{"status": 200, "result": [{{"id": "m{num}", "from": "{p}@example.com"}}]}}<|end|>')
    return out


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 2048, split_digits: bool = True):
    """Train a byte-level BPE tokenizer on `corpus`; returns a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------------------------
# Pretraining: a real base LLM arrives able to copy from its context; a randomly initialised one does
# not, and SFT on a few hundred demos cannot teach it in minutes: the model memorises the demos' ids
# instead of copying them (held-out easy TGC 0.0 after 6 or even 20 minutes of SFT). A short run on
# synthetic sequences in which a random span recurs after a short random gap gives the base a copy
# circuit (copy accuracy 0.0 -> 1.0 in 400 steps, ~2-3 min on 2 cores), and SFT on the same demos then
# reaches easy TGC 0.8. What forms at gaps <= 8 copies from a few dozen tokens back only (accuracy at gap
# 48: 0.01), and from a 1-token match: in a ten-symbol alphabet (ids are digit strings here) it is at
# chance (0.16 at gap 8), so an id that shares its first digit with another is miscopied (m8 for m58).
# The agent's ids sit a median 50-60 tokens back at L2-L5 (p90 218 at L4). Hence the reach curriculum
# (`pretrain_reach`, `pretrain_digit_rows`): once the short copy has formed (the first third of the
# steps), the gap grows to `pretrain_reach` and a share of rows is drawn from the ten digits only, so the
# copy must match on content over more than one token; from scratch at long gaps nothing forms in the same
# steps (loss flat at ln|V| after 300 steps). The sequences hold random tokens only: nothing of the tasks,
# the world or the expert conversations. Hand-written: a few lines of torch over synthetic data that no
# dataset library provides.
# ----------------------------------------------------------------------------------------------
class CopySequences:
    """[random prefix] span <|end|> [random gap] span: every row of a batch the same length; the tokens and the
    gap vary. `max_gap` (default the config's short gap) sets the length; `digit_rows` draws that share of the
    rows from the ten digit tokens only."""

    def __init__(self, tokenizer, cfg: TinyModelConfig, seed: int) -> None:
        import torch

        special = set(tokenizer.all_special_ids)
        self.vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
        digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
        self.digits = torch.tensor([d for d in digits if d is not None and d != tokenizer.unk_token_id and d not in special])
        self.sep = tokenizer.convert_tokens_to_ids(END)
        self.span, self.gap, self.reach = cfg.pretrain_span, cfg.pretrain_gap, max(cfg.pretrain_reach, cfg.pretrain_gap)
        self.digit_share = cfg.pretrain_digit_rows if len(self.digits) >= 2 else 0.0
        self.gen = torch.Generator().manual_seed(seed)
        self.torch = torch

    def _tokens(self, n: int, alphabet=None):
        torch = self.torch
        alphabet = self.vocab if alphabet is None else alphabet
        return alphabet[torch.randint(len(alphabet), (n,), generator=self.gen)]

    def schedule(self, step: int, steps: int) -> tuple[int, float]:
        """(max gap, share of digit rows) at `step` of `steps`: the short gap for the first third, then the gap
        grows linearly to the reach by three quarters of the steps and stays."""
        start, end = steps // 3, (3 * steps) // 4
        if self.reach <= self.gap or step <= start:
            return self.gap, 0.0
        grown = self.gap + (self.reach - self.gap) * min(1.0, (step - start) / max(1, end - start))
        return int(grown), self.digit_share

    def batch(self, size: int, max_gap: int | None = None, digit_rows: float = 0.0, exact: bool = False):
        """(input ids, labels): the loss falls on the repeat only (after its first token), the one part that can be
        predicted; the random tokens' irreducible loss would only add noise (the copy forms ~2x faster without it).
        `exact`: every gap is `max_gap` (the probes)."""
        torch = self.torch
        max_gap = self.gap if max_gap is None else max_gap
        n_digit = int(round(size * digit_rows))
        rows = []
        for r in range(size):
            alphabet = self.digits if r < n_digit else self.vocab
            gap = max_gap if exact else int(torch.randint(max_gap + 1, (1,), generator=self.gen))
            span = self._tokens(self.span, alphabet)
            rows.append(torch.cat([self._tokens(max_gap - gap, alphabet), span, torch.tensor([self.sep]),
                                   self._tokens(gap, alphabet), span]))
        ids = torch.stack(rows)
        labels = ids.clone()
        labels[:, : ids.shape[1] - self.span + 1] = -100
        return ids, labels

    def copy_accuracy(self, model, size: int = 64, max_gap: int | None = None, digit_rows: float = 0.0,
                      exact: bool = False) -> float:
        """Greedy accuracy on the repeat (after its first token): ~0 for a random model, ~1 once it copies."""
        torch = self.torch
        ids, _ = self.batch(size, max_gap, digit_rows, exact)
        with torch.no_grad():
            pred = model(input_ids=ids).logits.argmax(-1)
        return float((pred[:, -self.span:-1] == ids[:, -self.span + 1:]).float().mean())


def pretrain(model, tokenizer, cfg: TinyModelConfig, seed: int) -> dict[str, float]:
    """Train `model` in place for `cfg.pretrain_steps` steps; returns the loss and the copy accuracy before/after
    (within the short gap; with the reach curriculum also at the reach, and there in digits only)."""
    import torch
    from tqdm.auto import tqdm

    threads = torch.get_num_threads()
    if cfg.pretrain_threads:
        torch.set_num_threads(cfg.pretrain_threads)
    data = CopySequences(tokenizer, cfg, seed)
    held_out = CopySequences(tokenizer, cfg, seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_learning_rate, weight_decay=0.0)
    before = held_out.copy_accuracy(model.eval())
    model.train()
    loss_ema = 0.0
    bar = tqdm(range(1, cfg.pretrain_steps + 1), desc="pretraining the tiny base (in-context copy)", mininterval=2.0)
    for step in bar:
        gap, digit_rows = data.schedule(step, cfg.pretrain_steps)
        ids, labels = data.batch(cfg.pretrain_batch, gap, digit_rows)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_ema = float(loss.detach()) if step == 1 else 0.98 * loss_ema + 0.02 * float(loss.detach())
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss_ema:.3f}", gap=gap)
    model.eval()
    out = {"pretrain_steps": cfg.pretrain_steps, "pretrain_loss": round(loss_ema, 4),
           "copy_accuracy_before": round(before, 4), "copy_accuracy": round(held_out.copy_accuracy(model), 4)}
    if data.reach > data.gap:
        out["copy_accuracy_reach"] = round(held_out.copy_accuracy(model, 32, data.reach, exact=True), 4)
        if data.digit_share:
            out["copy_accuracy_reach_digits"] = round(held_out.copy_accuracy(model, 32, data.reach, 1.0, True), 4)
    torch.set_num_threads(threads)
    return out


def _fingerprint(cfg: TinyModelConfig, corpus: list[str], seed: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(cfg.model_dump(), sort_keys=True).encode())
    h.update(str(seed).encode())
    for text in corpus:
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def build_tiny_model(
    out_dir: str | os.PathLike,
    cfg: TinyModelConfig | None = None,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
) -> Path:
    """Build the tokenizer and a freshly initialised Llama-style model into `out_dir` (replaced whole)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = cfg or TinyModelConfig()
    texts = list(corpus) if corpus is not None else fallback_corpus(seed)
    if not texts:
        raise ValueError("build_tiny_model: the corpus is empty")
    started = time.perf_counter()
    tokenizer = build_tokenizer(texts, cfg.vocab_size, cfg.split_digits)
    mcfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(mcfg)
    pretrained: dict[str, float] = {}
    if cfg.pretrain_steps > 0:
        pretrained = pretrain(model, tokenizer, cfg, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out = Path(out_dir)
    with staged_dir(out) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        card = ModelCard(
            base_model="tiny",
            phase="tiny",
            extra={
                "fingerprint": _fingerprint(cfg, texts, seed),
                "parameters": sum(p.numel() for p in model.parameters()),
                "seed": seed,
                "build_seconds": round(time.perf_counter() - started, 3),
                "tiny_config": cfg.model_dump(),
                **pretrained,
            },
        )
        (staging / "agentrl.json").write_text(json.dumps(to_record(card), indent=1))
    return out


def ensure_tiny_model(
    out_dir: str | os.PathLike,
    cfg: TinyModelConfig | None = None,
    corpus: Iterable[str] | None = None,
    seed: int = 0,
) -> Path:
    """Build the tiny model unless `out_dir` already holds the one these inputs produce."""
    cfg = cfg or TinyModelConfig()
    texts = list(corpus) if corpus is not None else fallback_corpus(seed)
    out = Path(out_dir)
    card = out / "agentrl.json"
    if card.exists():
        try:
            if json.loads(card.read_text())["extra"]["fingerprint"] == _fingerprint(cfg, texts, seed):
                return out
        except (KeyError, json.JSONDecodeError):
            pass
    return build_tiny_model(out, cfg, texts, seed)
