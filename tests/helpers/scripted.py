"""A scripted policy for tests: a GenerationBackend that answers with text chosen by a Python function.

It exercises the real rollout, environment, evaluation and registry with behaviour we choose (an expert,
a deliberately unsafe agent), without training a model for it.
"""

from __future__ import annotations

import json
import re

from components.core.generation import GenOutput
from components.sandbox.expert import render_code, render_json


class ScriptedBackend:
    def __init__(self, tokenizer, script):
        self.tok, self.script, self.eos_id = tokenizer, script, tokenizer.eos_token_id

    def generate(self, prompts, params, sessions=None):
        outs = []
        for p in prompts:
            text = self.script(self.tok.decode(p))
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos_id]
            outs.append(GenOutput(ids, [0.0] * len(ids), True))
        return outs

    def end_sessions(self, keys=None):
        pass

    def sync(self, model):
        pass


def tasks_by_instruction(sandbox) -> dict:
    """Every task by its instruction; where an instruction repeats across suites (the same request with other
    options), the held-out suites' task wins, since those are the ones evaluated."""
    order = sorted(sandbox.suites, key=lambda name: name not in ("train", "practice"))
    return {t.instruction: t for name in order for t in sandbox.suites[name]}


def expert_script(sandbox):
    """The expert's next step for the task whose instruction is in the prompt."""
    by_instruction = tasks_by_instruction(sandbox)

    def script(prompt: str) -> str:
        task = next(t for i, t in by_instruction.items() if i in prompt)
        done = prompt.count("<|tool|>")
        steps = task.solution["steps"]
        step = steps[min(done, len(steps) - 1)]
        args = json.loads(json.dumps(step["args"]))
        drafts = re.findall(r'"draft":"(d\d+)"', prompt)
        if drafts:
            args = json.loads(json.dumps(args).replace("$draft", drafts[-1]))
        ids = re.findall(r'"id":"([fe]\d+)"}}', prompt)
        if ids:
            args = json.loads(json.dumps(args).replace("$id", ids[-1]))
        return render_json(step["thought"], step["tool"], args)

    return script


def code_script(sandbox, reuse: bool):
    """A code-form agent: defines the task's skill (or calls it when the library offers it), then finishes."""
    by_instruction = tasks_by_instruction(sandbox)

    def script(prompt: str) -> str:
        task = next(t for i, t in by_instruction.items() if i in prompt)
        if "<|tool|>" in prompt:
            return render_json("Done.", "finish", {})
        sk = task.solution["skill"]
        offered = re.search(r"Skills you can call: (.*)", prompt)
        if reuse and offered and sk["name"] in offered.group(1):
            return render_code(f"I will use {sk['name']}.", sk["call"] + "\napis.finish()")
        return render_code("I will write it.", sk["source"] + "\n\n" + sk["call"] + "\napis.finish()")

    return script
