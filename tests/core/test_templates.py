"""Agent-token masks from stock chat templates (no `{% generation %}` marker): ChatML, Llama 3, Mistral [INST]
and a template without a system role. For a multi-turn episode the masked tokens decode to exactly the agent's
text and its turn-ending token, the whole encoding renders as the template does, and the rollout's incremental
encoding gives the same ids."""

from __future__ import annotations

import pytest

from components.core.config import ModelConfig
from components.core.policy import ModelLoadError, prepare_tokenizer
from components.core.tokens import ChatFormat, TemplateError, encode_messages

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL = (  # the Mistral-7B-Instruct-v0.1 template: user/assistant only, strictly alternating
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
GEMMA = (  # Gemma's: no system role, user/assistant alternating; the assistant is 'model'
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# template -> (special tokens, bos, eos, unk, pad, the token that ends an assistant turn)
TEMPLATES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", None, None, "<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], "<|begin_of_text|>", "<|end_of_text|>", None, None, "<|eot_id|>"),
    "mistral": (MISTRAL, ["<s>", "</s>", "<unk>"], "<s>", "</s>", "<unk>", None, "</s>"),
    "no_system": (GEMMA, ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", None,
                  "<pad>", "<end_of_turn>"),
}
SYSTEM, USER = "You are a workspace agent.", "Move message m3 to Archive."
ACTIONS = ['{"tool": "mail.search", "args": {"query": "m3"}}', '{"tool": "mail.move", "args": {"id": "m3"}}',
           '{"tool": "finish", "args": {}}']
OBS = ['{"ok": true, "result": ["m3"]}', '{"ok": true}']


def make_tokenizer(name: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, specials, bos, eos, unk, pad, _ = TEMPLATES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [SYSTEM, USER, *ACTIONS, *OBS, "Observation:", "assistant user tool system model"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = template
    return fast


def episode() -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    for i, action in enumerate(ACTIONS):
        msgs.append({"role": "assistant", "content": action})
        if i < len(OBS):
            msgs.append({"role": "tool", "content": OBS[i]})
    return msgs


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_masked_tokens_are_exactly_the_agents_text(name):
    tok = prepare_tokenizer(make_tokenizer(name), name, ModelConfig())
    stop = TEMPLATES[name][-1]
    ids, mask = encode_messages(tok, episode())
    agent = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert agent == "".join(a + stop for a in ACTIONS)
    other = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    for text in (SYSTEM, USER, *OBS):
        assert text in other and text not in agent
    fmt = ChatFormat(tok)
    assert tok.decode(ids) == fmt.render(fmt.normalize(episode()))  # nothing added, nothing lost


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rollout_encoding_gives_the_same_ids(name):
    """The rollout builds an episode from prompt ids, sampled ids and glue: the same ids SFT trains on."""
    tok = prepare_tokenizer(make_tokenizer(name), name, ModelConfig())
    fmt = ChatFormat(tok)
    ids = fmt.prompt_ids(SYSTEM, USER)
    mask = [0] * len(ids)
    for i, action in enumerate(ACTIONS):
        gen = fmt.encode(action) + [fmt.eos_id]
        ids, mask = ids + gen, mask + [1] * len(gen)
        glue = fmt.glue_ids(OBS[i], ended_with_eos=True) if i < len(OBS) else fmt.closing_ids(True)
        ids, mask = ids + glue, mask + [0] * len(glue)
    assert (ids, mask) == encode_messages(tok, episode())


def test_roles_pad_and_turn_end_per_template():
    formats = {n: ChatFormat(prepare_tokenizer(make_tokenizer(n), n, ModelConfig())) for n in TEMPLATES}
    assert {n: f.obs_role for n, f in formats.items()} == {"chatml": "tool", "llama3": "tool", "mistral": "user",
                                                            "no_system": "user"}
    assert {n: f.system_role for n, f in formats.items()} == {"chatml": True, "llama3": True, "mistral": False,
                                                               "no_system": False}
    # observations as user turns carry the prefix; the system text opens the first user turn
    mistral = formats["mistral"]
    text = mistral.render(mistral.normalize(episode()))
    assert f"[INST] Observation:\n{OBS[0]} [/INST]" in text and text.startswith(f"<s>[INST] {SYSTEM}\n\n{USER} [/INST]")
    # no pad token: the eos pads (Mistral, ChatML); padding on the left; Llama 3 and Gemma end turns elsewhere
    for name, fmt in formats.items():
        tok = fmt.tok
        assert tok.pad_token is not None and tok.padding_side == "left"
        assert tok.eos_token == TEMPLATES[name][-1] == fmt.eos_text
    assert formats["mistral"].tok.pad_token == "</s>" and formats["no_system"].tok.pad_token == "<pad>"


def test_observation_role_can_be_forced_and_prefixed():
    tok = prepare_tokenizer(make_tokenizer("chatml"), "chatml",
                            ModelConfig(observation_role="user", observation_prefix="Tool result:\n"))
    fmt = ChatFormat(tok)
    assert fmt.obs_role == "user" and "<|im_start|>user\nTool result:\n" + OBS[0] in fmt.render(fmt.normalize(episode()))
    with pytest.raises(ModelLoadError, match="does not render a `tool` turn"):
        prepare_tokenizer(make_tokenizer("mistral"), "mistral", ModelConfig(observation_role="tool"))


def test_a_template_that_rewrites_history_is_refused_with_a_way_out(tmp_path):
    """Like Qwen3's: earlier assistant turns are rendered without their reasoning once a later turn exists."""
    drops = ("{% for message in messages %}{% set c = message['content'] %}"
             "{% if message['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
             "{{ '<|im_start|>' + message['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tok = make_tokenizer("chatml")
    tok.chat_template = drops
    fmt = ChatFormat(tok)  # the sentinel episode has no reasoning: the format itself builds
    msgs = episode()
    msgs[2] = {"role": "assistant", "content": "<think>look first</think>" + ACTIONS[0]}
    with pytest.raises(TemplateError, match="re-renders earlier turns.*model.chat_template"):
        fmt.encode_conversation(msgs)
    # the way out: a built-in template that only appends
    fixed = prepare_tokenizer(make_tokenizer("chatml"), "chatml", ModelConfig(chat_template="chatml"))
    ids, mask = encode_messages(fixed, msgs)
    assert "<think>look first</think>" in fixed.decode([i for i, m in zip(ids, mask, strict=True) if m])
    jinja = tmp_path / "t.jinja"
    jinja.write_text(CHATML)
    assert prepare_tokenizer(make_tokenizer("chatml"), "x", ModelConfig(chat_template=str(jinja))).chat_template == CHATML
    with pytest.raises(ModelLoadError, match="model.chat_template='nope'"):
        prepare_tokenizer(make_tokenizer("chatml"), "x", ModelConfig(chat_template="nope"))


def test_marker_masks_agree_where_the_template_has_them(tmp_path):
    """The tiny model's template marks assistant turns with {% generation %}: its masks and ours are the same."""
    from components.core.tiny import build_tokenizer, fallback_corpus

    tok = build_tokenizer(fallback_corpus(n=200), vocab_size=600)
    msgs = episode()
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = encode_messages(tok, msgs)
    assert ids == list(out["input_ids"]) and mask == list(out["assistant_masks"])


def test_train_from_masks_assistant_turns_in_the_prompt():
    tok = prepare_tokenizer(make_tokenizer("chatml"), "chatml", ModelConfig())
    ids, mask = encode_messages(tok, episode(), train_from=4)  # the first action is context (a failed attempt)
    agent = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert agent == ACTIONS[1] + "<|im_end|>" + ACTIONS[2] + "<|im_end|>"


QWEN_TOOLS = (  # ChatML with a tools block in the system turn, as Qwen 2.5 / Hermes templates write it
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (m['role'] == 'system' and loop.first) %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "mail_move", "description": "move a message",
                                           "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}}]
FOLLOW_UP = "Thanks. Also archive m4."


@pytest.mark.parametrize("template", ["native", "fallback"])
def test_tools_and_a_users_follow_up_are_encoded_as_the_rollout_samples_them(template):
    """Tools go through the template's `tools=` where it takes them, else into the system text; an observation in the
    user role (the user speaking mid-episode) is glued in that role: the rollout's ids equal the conversation's."""
    raw = make_tokenizer("chatml")
    if template == "native":
        raw.chat_template = QWEN_TOOLS
    tok = prepare_tokenizer(raw, "chatml", ModelConfig())
    fmt = ChatFormat(tok)
    assert fmt.native_tools == (template == "native")
    observations = [(OBS[0], "tool"), (FOLLOW_UP, "user")]
    ids = fmt.prompt_ids(SYSTEM, USER, TOOLS)
    mask = [0] * len(ids)
    msgs = [{"role": "system", "content": SYSTEM, "tools": TOOLS}, {"role": "user", "content": USER}]
    for i, action in enumerate(ACTIONS):
        gen = fmt.encode(action) + [fmt.eos_id]
        ids, mask = ids + gen, mask + [1] * len(gen)
        msgs.append({"role": "assistant", "content": action})
        if i < len(observations):
            glue = fmt.glue_ids(observations[i][0], ended_with_eos=True, role=observations[i][1])
            msgs.append({"role": observations[i][1], "content": observations[i][0]})
        else:
            glue = fmt.closing_ids(True)
        ids, mask = ids + glue, mask + [0] * len(glue)
    assert (ids, mask) == encode_messages(tok, msgs)
    text = tok.decode(ids)
    assert f"<|im_start|>user\n{FOLLOW_UP}<|im_end|>" in text
    assert ('<tools>{"type": "function"' in text) if template == "native" else \
        (f"{SYSTEM}\n\nTools (JSON schemas):\n" + '{"type":"function"' in text)
