"""`python -m components.sft --args '<json>'`: the SFT phase as a process of its own.

On a pod with several GPUs, `launch` re-launches this module under torchrun (one process per
GPU; DeepSpeed ZeRO shards the model across them); rank 0 does the tracking and the saving.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m components.sft")
    p.add_argument("--args", required=True, help="JSON object of components.sft.run keyword arguments")
    p.add_argument("--result", default=None, help="write the result (JSON) here (rank 0)")
    ns = p.parse_args(argv)
    from components.sft.recipe import run

    res = run(**json.loads(ns.args))
    if ns.result and res is not None:  # a path, or an s3:// URI when a multi-node job reports back
        from components.core import storage

        storage.write_text(ns.result, json.dumps(res.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
