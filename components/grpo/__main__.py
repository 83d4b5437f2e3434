"""`python -m components.grpo --args '<json>'`: the GRPO phase as a process of its own (torchrun, a multi-node
job, tests)."""

from __future__ import annotations

import sys

from components.core.phase import main
from components.grpo.recipe import run

if __name__ == "__main__":
    sys.exit(main("components.grpo", run))
