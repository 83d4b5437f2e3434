"""The hf backend's decoding loop: it samples as transformers' `generate` does, and carrying an episode's KV cache
across its turns changes nothing but the work (same ids, same log-probs, a fraction of the prefill)."""

from __future__ import annotations

import os

import pytest
import torch

from components.core.generation import HFBackend, SamplingParams, score_logprobs
from components.core.policy import load_policy
from components.core.rollout import RolloutSettings, rollout
from components.core.tiny import set_torch_threads
from components.core.tokens import ChatFormat
from components.sandbox.workspace import WorkspaceEnv
from tests.helpers.runtime import episode_ids

set_torch_threads(1)


@pytest.fixture(scope="module")
def policy(tiny):
    return load_policy(str(tiny))


def prompts_of(policy, sandbox, n):
    cfg, world, suites = sandbox
    fmt = ChatFormat(policy.tokenizer)
    env = WorkspaceEnv(world, cfg)
    out = []
    for t in suites["easy"][:n]:
        out.append(fmt.prompt_ids(env.system_prompt, env.reset(t)))
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=20),
                                    SamplingParams(temperature=1.0, max_new_tokens=20, seed=7),
                                    SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20, seed=3)],
                         ids=["greedy", "sampled", "warped"])
def test_the_loop_samples_like_transformers_generate(policy, sandbox, params):
    tok, model = policy.tokenizer, policy.model
    prompts = prompts_of(policy, sandbox, 6)
    mine = HFBackend(model, tok, batch_size=8).generate(prompts, params)
    width = max(len(p) for p in prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # the backend's batch order
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    for r, i in enumerate(order):
        ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
        attn[r, width - len(prompts[i]):] = 1
    kw = dict(do_sample=False) if params.greedy else dict(do_sample=True, temperature=params.temperature,
                                                           top_p=params.top_p, top_k=0)
    if params.seed is not None:
        torch.manual_seed(params.seed)
    ref = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=params.max_new_tokens,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
    for r, i in enumerate(order):
        row = ref[r, width:].tolist()
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        assert mine[i].ids == row
        rescored = score_logprobs(model, prompts[i] + row)[len(prompts[i]):]
        assert max(abs(a - b) for a, b in zip(rescored, mine[i].logprobs, strict=True)) < 1e-4


def run_rollouts(policy, sandbox, kv_reuse, temperature):
    cfg, world, suites = sandbox
    backend = HFBackend(policy.model, policy.tokenizer, batch_size=16, kv_reuse=kv_reuse)
    settings = RolloutSettings(group_size=2, max_turns=5, max_new_tokens=24, temperature=temperature, seed=11,
                               max_live=16, progress=False)
    trajs = rollout(backend, lambda: WorkspaceEnv(world, cfg), ChatFormat(policy.tokenizer), suites["easy"][:12],
                    settings)
    assert not backend._sessions and not backend._pool  # nothing cached outlives the rollout
    return trajs, backend.prefilled


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_kv_reuse_is_token_exact_and_prefills_only_new_tokens(policy, sandbox, temperature):
    plain, prefill_plain = run_rollouts(policy, sandbox, False, temperature)
    reused, prefill_reused = run_rollouts(policy, sandbox, True, temperature)
    assert sum(t.steps >= 3 for t in plain) >= 12  # multi-turn episodes, where reuse has something to reuse
    worst = 0.0
    for a, b in zip(plain, reused, strict=True):
        ids_a, mask_a, lps_a = episode_ids(a)
        ids_b, mask_b, lps_b = episode_ids(b)
        assert ids_a == ids_b and mask_a == mask_b
        worst = max([worst] + [abs(x - y) for x, y in zip(lps_a, lps_b, strict=True)])
        rescored = score_logprobs(policy.model, ids_b)
        worst = max([worst] + [abs(rescored[i] - lps_b[i]) for i, m in enumerate(mask_b) if m])
    assert worst < 1e-4, worst
    assert prefill_reused < prefill_plain / 2, (prefill_reused, prefill_plain)


def test_a_prompt_that_leaves_the_cached_path_is_prefilled_from_where_it_differs(policy, sandbox):
    p1, p2 = prompts_of(policy, sandbox, 2)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    be = HFBackend(policy.model, policy.tokenizer, batch_size=4)
    first = be.generate([p1], sp, sessions=["s"])[0]
    forked = p1[: len(p1) // 2] + p2  # shares only a prefix with what is cached
    before = be.prefilled
    got = be.generate([forked], sp, sessions=["s"])[0]
    assert be.prefilled - before == len(forked) - len(p1) // 2
    fresh = HFBackend(policy.model, policy.tokenizer, batch_size=4).generate([forked], sp)[0]
    assert got.ids == fresh.ids and max(abs(a - b) for a, b in zip(got.logprobs, fresh.logprobs, strict=True)) < 1e-4
    cont = p1 + first.ids + p2[-5:]  # the usual case: the cached turn continued
    before = be.prefilled
    be.generate([forked], sp, sessions=["other"])
    be.generate([cont], sp, sessions=["s"])
    assert be.prefilled - before == len(forked) + len(cont) - len(forked[: len(p1) // 2])
    be.update_weights(policy.model)  # new weights: no cache survives
    assert not be._sessions


def test_shared_prefixes_are_prefilled_once(policy, sandbox):
    """A group's samples start from one prompt, and episodes share their system prompt: each shared prefix is
    prefilled once; the samples are those of a backend that prefills everything."""
    tok = policy.tokenizer
    p1, p2, p3 = prompts_of(policy, sandbox, 3)
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    group = [p1, p1, p1, p1]
    be = HFBackend(policy.model, tok, batch_size=8)
    got = be.generate(group, sp, sessions=["a", "b", "c", "d"])
    assert be.prefilled == len(p1) + 4  # the prompt once, then each sample's last token
    ref = HFBackend(policy.model, tok, batch_size=8, kv_reuse=False).generate(group, sp)
    for g, r in zip(got, ref, strict=True):
        assert g.ids == r.ids and max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs, strict=True)) < 1e-4
    assert len({tuple(g.ids) for g in got}) > 1  # four samples, not one copied
    # different tasks under one system prompt (a tool catalogue): that prompt once, the rest per episode
    cfg, world, suites = sandbox
    fmt, env = ChatFormat(tok), WorkspaceEnv(world, cfg)
    system = "Tools: mail.search, mail.send, files.read, calendar.create, chat.post. Call finish when done."
    p1, p2, p3 = (fmt.prompt_ids(system, env.reset(t)) for t in suites["easy"][:3])
    be = HFBackend(policy.model, tok, batch_size=8)
    common = min(len(os.path.commonprefix([p1, p2])), len(os.path.commonprefix([p1, p3])))
    assert common >= 16
    be.generate([p1, p2, p3], sp, sessions=["x", "y", "z"])
    assert be.prefilled == common + sum(len(p) - common for p in (p1, p2, p3))
    be.end_sessions()
    assert not be._pool and not be._sessions
