"""`python -m components.grpo --args '<json>'`: the GRPO phase as a process of its own (KFP retries, tests)."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m components.grpo")
    p.add_argument("--args", required=True, help="JSON object of components.grpo.run keyword arguments")
    p.add_argument("--result", default=None, help="write the result (JSON) here")
    ns = p.parse_args(argv)
    from components.grpo.recipe import run

    res = run(**json.loads(ns.args))
    if ns.result and res is not None:
        from components.core import storage

        storage.write_text(ns.result, json.dumps(res.__dict__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
