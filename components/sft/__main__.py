"""`python -m components.sft --args '<json>'`: the SFT phase as a process of its own.

On a pod with several GPUs, `launch` re-launches this module under torchrun (one process per GPU; DeepSpeed ZeRO
shards the model across them); rank 0 does the tracking and the saving.
"""

from __future__ import annotations

import sys

from components.core.phase import main
from components.sft.recipe import run

if __name__ == "__main__":
    sys.exit(main("components.sft", run))
