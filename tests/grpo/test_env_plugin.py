"""An environment from a package outside agentrl, registered by entry point, driven by rollout, evaluation and one
GRPO step: the user speaks mid-episode (a `user` turn, rendered token exact) and one reply holds two tool calls.

The package is written to a temporary folder with its dist-info (what `pip install` leaves), so importlib.metadata
finds its `agentrl.environment_loaders` entry point exactly as it finds an installed one. The policy is scripted
(behaviour chosen: the calls the test needs); the rollout, the environment, the evaluation and the GRPO update are
real."""

from __future__ import annotations

import json
import textwrap

import pytest

from components.core.config import load_config
from components.core.env import load, loader_names
from components.core.evaluate import evaluate_policy
from components.core.policy import load_policy
from components.core.rollout import RolloutSettings, rollout
from components.core.tokens import ChatFormat, encode_messages, messages
from components.grpo import recipe
from tests.helpers.runtime import episode_ids
from tests.helpers.scripted import ScriptedBackend

pytestmark = pytest.mark.slow

PACKAGE = '''
"""A counter with two tools; the user asks for one more addition after the agent says it is done."""
import json
from dataclasses import dataclass

from components.core.env import StepResult
from components.core.schema import RewardBreakdown, Task, Trajectory, Turn, Verdict

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add n to the counter.",
          "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
         {"type": "function", "function": {"name": "get", "description": "The counter.",
          "parameters": {"type": "object", "properties": {}}}}]


class Counter:
    system_prompt = "Use the tools; reply without a call when done."
    tools = TOOLS

    def reset(self, task):
        self.task, self.value, self.followed = task, 0, False
        return task.instruction

    def step(self, text):
        try:
            calls = json.loads(text)
        except ValueError:
            if not self.followed:
                self.followed = True
                return StepResult(f"Now add {self.task.payload['then']}.", role="user")
            return StepResult("bye", done=True)
        out = []
        for c in calls if isinstance(calls, list) else [calls]:
            if c["name"] == "add":
                self.value += int(c["arguments"]["n"])
            out.append(str(self.value))
        return StepResult(" ".join(out), step_reward=0.1 * len(out), info={"calls": len(out)})

    def verify(self):
        return Verdict(self.value == self.task.payload["target"] and self.followed)

    def close(self):
        pass


def task(i, suite):
    a, b, c = i, i + 1, 2
    return Task(id=f"{suite}-{i}", instruction=f"Add {a} and {b}.", suite=suite,
                payload={"adds": [a, b], "then": c, "target": a + b + c})


@dataclass
class Loaded:
    suites: dict
    heldout: tuple = ("probe",)

    def online_tasks(self, pool="practice"):
        return self.suites["train"]

    def factory(self, action_format=None):
        return Counter

    def expert(self, env, task, action_format=None):
        return None  # no expert solutions: phases go without (no repair sample, no correction)


def load(cfg, world_path=None, tasks_dir=None, **options):
    n = int(options.get("tasks", 4))
    return Loaded({"train": [task(i, "train") for i in range(n)], "probe": [task(i, "probe") for i in range(3)]})
'''


@pytest.fixture
def counter_package(tmp_path, monkeypatch):
    root = tmp_path / "site"
    (root / "counterenv").mkdir(parents=True)
    (root / "counterenv" / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    info = root / "counterenv-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: counterenv\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[agentrl.environment_loaders]\ncounter = counterenv:load\n")
    monkeypatch.syspath_prepend(str(root))
    return root


def script(prompt: str) -> str:
    """Two calls at once; after the user's follow-up, the one it asks for; else the end of the turn."""
    last_user = prompt.rsplit("<|user|>", 1)[1]
    if "Now add" in last_user and "<|tool|>" not in last_user:
        return json.dumps({"name": "add", "arguments": {"n": int(last_user.split("Now add ")[1].split(".")[0])}})
    if "<|tool|>" in prompt:
        return "All done."
    first, second = (int(x) for x in last_user.split("Add ")[1].split(".")[0].split(" and "))
    return json.dumps([{"name": "add", "arguments": {"n": first}}, {"name": "add", "arguments": {"n": second}}])


def test_an_outside_environment_drives_rollout_evaluation_and_a_grpo_step(counter_package, tmp_path, monkeypatch,
                                                                         tiny_model_dir):
    assert "counter" in loader_names()
    ov = {"run": {"home": str(tmp_path / "home")}, "env": {"name": "counter", "options": {"tasks": 4}},
          "generation": {"max_new_tokens": 48, "max_context_tokens": 1024},
          "grpo": {"steps": 1, "tasks_per_step": 2, "group_size": 2, "micro_batch_size": 4, "eval_every": 1,
                   "eval_max_tasks": 3, "checkpoint_every": 1, "checkpoint_uri": str(tmp_path / "ckpt"),
                   "group_filter": "none", "torch_threads": 1, "repair": {"every_k_steps": 0}}}
    cfg = load_config(overrides_json=json.dumps(ov))
    env = load(cfg)
    pol = load_policy(str(tiny_model_dir))
    fmt = ChatFormat(pol.tokenizer)
    backend = ScriptedBackend(pol.tokenizer, script)

    # rollout: two calls in the first reply, the user's follow-up, the call it asks for, the end
    trajs = rollout(backend, env.factory(), fmt, env.suites["train"][:2], RolloutSettings(max_turns=6, progress=False))
    t = trajs[0]
    assert [x.role for x in t.turns] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant",
                                         "tool", "assistant", "tool"]
    assert t.turns[3].text == "0 1" and t.turns[3].info == {"calls": 2} and t.turns[5].text == "Now add 2."
    assert t.verdict.success and t.reward.components["step"] == pytest.approx(0.3)
    assert t.turns[0].info["tools"][0]["function"]["name"] == "add"
    # token exact: the ids the rollout built are the template's rendering of the same conversation (tools included,
    # the follow-up in the user role), the agent mask on the sampled turns only
    ids, mask, _ = episode_ids(t)
    ref_ids, ref_mask = encode_messages(pol.tokenizer, messages(t))
    n = sum(len(x.tokens) for x in t.turns[:-1])  # through the last reply (the closing observation is not sampled on)
    assert n > 0 and ids[:n] == ref_ids[:n] and mask[:n] == ref_mask[:n] and sum(mask) == sum(ref_mask)
    assert "Tools (JSON schemas):" in pol.tokenizer.decode(ids)  # the tiny template takes no tools=: in the system
    assert all(x.credit is not None for x in t.turns if x.role == "assistant")  # per-turn credit across the user turn

    # evaluation on the environment's own held-out suite
    res = evaluate_policy(pol, cfg, env, backend=backend, pass_k=1, progress=False)
    assert set(res["metrics"]) == {"probe"} and res["metrics"]["probe"]["tgc"]["value"] == 1.0

    # one GRPO step with the environment chosen by name (the scripted sampler, real training)
    monkeypatch.setattr(recipe, "make_backend", lambda *a, **k: ScriptedBackend(pol.tokenizer, script))
    out = recipe.run(overrides=json.dumps(ov), policy_model=str(tiny_model_dir), model_out=str(tmp_path / "out"),
                     work_dir=str(tmp_path / "work"))
    assert out.steps_done == 1
    assert out.metrics["heldout/probe/tgc"] == 1.0 and out.metrics["heldout/tgc_mean"] == 1.0
