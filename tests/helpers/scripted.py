"""A scripted policy for tests: a GenerationBackend that answers with text chosen by a Python function.

It exercises the real rollout, environment, evaluation and registry with behaviour we choose (an expert,
a deliberately unsafe agent), without training a model for it.
"""

from __future__ import annotations

from components.core.generation import GenOutput


class ScriptedBackend:
    def __init__(self, tokenizer, script):
        self.tok, self.script, self.eos_id = tokenizer, script, tokenizer.eos_token_id

    def generate(self, prompts, params):
        outs = []
        for p in prompts:
            text = self.script(self.tok.decode(p))
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos_id]
            outs.append(GenOutput(ids, [0.0] * len(ids), True))
        return outs
