"""The vllm backend passes the hf backend's tests: token-exact logprobs, masks, weight updates, LoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.core.generation import SamplingParams, VLLMBackend, score_logprobs
from components.core.rollout import RolloutSettings, rollout
from components.core.tiny import set_torch_threads
from components.core.tokens import ChatFormat
from components.sandbox.workspace import WorkspaceEnv
from tests.helpers.runtime import episode_ids

set_torch_threads(1)


@pytest.fixture(scope="module")
def backend(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    return VLLMBackend(str(tiny), tok, max_model_len=2048, gpu_memory_utilization=0.3, enforce_eager=True,
                       dtype="float32")


def greedy_hf(model, prompt, tok, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    return out[0, len(prompt):].tolist()


def test_token_exact_multi_turn_rollouts(backend, tiny, sandbox):
    cfg, world, suites = sandbox
    tok = AutoTokenizer.from_pretrained(tiny)
    fmt = ChatFormat(tok)
    trajs = rollout(backend, lambda: WorkspaceEnv(world, cfg), fmt, suites["easy"][:10],
                    RolloutSettings(group_size=2, max_turns=4, max_new_tokens=24, progress=False))
    model = AutoModelForCausalLM.from_pretrained(tiny)
    worst = 0.0
    assert sum(t.steps >= 2 for t in trajs) >= 15
    for tr in trajs:
        ids, mask, lps = episode_ids(tr)
        for t in tr.turns:
            if t.role != "assistant":
                assert not any(t.mask or [])
        rescored = score_logprobs(model, ids)
        worst = max([worst] + [abs(rescored[i] - lps[i]) for i, m in enumerate(mask) if m])
    assert worst < 1e-4, worst


def test_weight_update_then_greedy_equals_transformers(backend, tiny, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny)
    prompt = ChatFormat(tok).prompt_ids("system", "Move message m3 to Archive.")
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    new = AutoModelForCausalLM.from_pretrained(tiny)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    new.save_pretrained(tmp_path / "new")
    before = backend.generate([prompt], sp)[0].ids
    backend.update_weights(str(tmp_path / "new"))  # from a directory
    after = backend.generate([prompt], sp)[0].ids
    assert after != before
    assert after == greedy_hf(new, prompt, tok, 16)[: len(after)]
    # from an in-memory model (what an RL step hands over), back to the original weights
    orig = AutoModelForCausalLM.from_pretrained(tiny)
    backend.update_weights(orig)
    again = backend.generate([prompt], sp)[0].ids
    assert again == greedy_hf(orig, prompt, tok, 16)[: len(again)]


def test_lora_adapter_greedy_equals_peft(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model

    tok = AutoTokenizer.from_pretrained(tiny)
    base = AutoModelForCausalLM.from_pretrained(tiny)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.2)
    peft_model.save_pretrained(tmp_path / "adapter")
    be = VLLMBackend(str(tiny), tok, max_model_len=1024, gpu_memory_utilization=0.3, enforce_eager=True,
                     dtype="float32", enable_lora=True, max_lora_rank=8)
    prompt = ChatFormat(tok).prompt_ids("system", "Post 'standup at 10' in budget-1.")
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    plain = be.generate([prompt], sp)[0].ids
    be.load_adapter(str(tmp_path / "adapter"))
    adapted = be.generate([prompt], sp)[0]
    assert adapted.ids == greedy_hf(peft_model, prompt, tok, 16)[: len(adapted.ids)]
    assert adapted.ids != plain
    rescored = score_logprobs(peft_model, prompt + adapted.ids)[len(prompt):]
    assert max(abs(a - b) for a, b in zip(rescored, adapted.logprobs, strict=True)) < 1e-4
