"""Recovery supervision: an error at any turn of an expert demo, the environment's refusal, the expert's correction."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from components.core import env as environments
from components.core.config import load_config
from components.core.recovery import miscopy, recovery_examples


@pytest.fixture(scope="module")
def workspace():
    cfg = load_config()
    sandbox = environments.load(cfg)
    episode = sandbox.factory()()
    demos = [d for d in (sandbox.expert(episode, t, action_format="json") for t in sandbox.suites["train"][::4]) if d]
    episode.close()
    return cfg, sandbox, demos


def test_miscopy_changes_one_id_or_name_and_nothing_else():
    action = 'Thought: read it.\n{"tool": "mail.move", "args": {"ids": ["m81", "m118"], "folder": "Finance"}}'
    seen = set()
    for s in range(30):
        wrong = miscopy(action, random.Random(s))
        a, b = json.loads(action.split("\n")[1])["args"], json.loads(wrong.split("\n")[1])["args"]
        changed = [x != y for x, y in zip(a["ids"] + [a["folder"]], b["ids"] + [b["folder"]], strict=True)]
        assert sum(changed) == 1 and wrong.startswith("Thought: read it.\n")
        seen.add(changed.index(True))
    assert seen == {0, 1}  # items of a list argument are miscopied too (the folder name matches no id or name form)
    assert miscopy('Thought: done.\n{"tool": "finish", "args": {}}', random.Random(0)) is None
    assert miscopy("Thought: broken\n{not json", random.Random(0)) is None


def test_recovery_examples_refused_at_any_turn_then_corrected(workspace):
    cfg, sandbox, demos = workspace
    exs = recovery_examples(demos, sandbox, seed=0, ratio=1.0)
    assert len(exs) == len(demos)
    codes, turns = Counter(), Counter()
    for ex in exs:
        wrong, refusal = ex["prompt"][-2], ex["prompt"][-1]
        assert wrong["role"] == "assistant" and '"ok":false' in refusal["content"]
        assert ex["completion"][0]["role"] == "assistant" and ex["completion"][0]["content"] != wrong["content"]
        codes[json.loads(refusal["content"])["error"]["code"]] += 1
        turns[sum(m["role"] == "assistant" for m in ex["prompt"])] += 1
    assert codes[404] + codes[403] >= len(exs) // 4  # miscopied ids and names, not format errors only
    assert sum(n for k, n in turns.items() if k > 1) >= len(exs) // 3  # past the first turn
    assert recovery_examples(demos, sandbox, seed=0, ratio=0.0) == []
    assert len(recovery_examples(demos, sandbox, seed=0, ratio=0.25)) == round(0.25 * len(demos))


def test_the_correction_still_solves_the_task_after_the_mistake(workspace):
    """Replayed in a fresh episode, the prompt's turns, the mistake and then the completion reach the demo's own
    observations and a verified success: the continuation the model is trained on is right after the error."""
    cfg, sandbox, demos = workspace
    tasks = {t.id: t for t in sandbox.suites["train"]}
    by_system_user = {(d.turns[0].text, d.turns[1].text): d for d in demos}
    episode = sandbox.factory()()
    try:
        for ex in recovery_examples(demos, sandbox, seed=1, ratio=0.3):
            demo = by_system_user[(ex["prompt"][0]["content"], ex["prompt"][1]["content"])]
            episode.reset(tasks[demo.task_id])
            convo = ex["prompt"] + ex["completion"]
            res = None
            for i, m in enumerate(convo):
                if m["role"] == "assistant" and i >= 2:
                    res = episode.step(m["content"])
                    assert res.observation == convo[i + 1]["content"]
            assert res is not None and res.done and episode.verify().success, demo.task_id
    finally:
        episode.close()


def test_the_loss_falls_on_the_corrected_turns_only(workspace, tiny):
    """The demo's earlier turns and the mistake are context: the agent mask covers the completion's agent turns."""
    from components.core.policy import load_policy
    from components.core.tokens import encode_messages

    _, sandbox, demos = workspace
    tok = load_policy(str(tiny)).tokenizer
    ex = next(e for e in recovery_examples(demos, sandbox, seed=2, ratio=1.0)
              if sum(m["role"] == "assistant" for m in e["prompt"]) > 1)
    ids, mask = encode_messages(tok, ex["prompt"] + ex["completion"], train_from=len(ex["prompt"]))
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    expected = "".join(m["content"] + tok.eos_token for m in ex["completion"] if m["role"] == "assistant")
    assert trained == expected
    assert ex["prompt"][-2]["content"] not in trained
