"""`make bench`: run every benchmark, print a table, write $AGENTRL_HOME/bench.json."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table


def main() -> int:
    import boto3

    from components.core.tiny import set_torch_threads
    from components.core.tracking import local_tracking_uri
    from tests.benchmarks import async_grpo, core, grpo, real_model, runtime, sandbox
    from tests.helpers.servers import MotoServer

    set_torch_threads(1)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    home = Path(os.environ.get("AGENTRL_HOME", ".agentrl")).resolve()
    home.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as work:
        moto = MotoServer(Path(work)).start()
        try:
            os.environ["AWS_ENDPOINT_URL"] = moto.url
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=moto.url).create_bucket(Bucket=bucket)
            steps = [
                ("tiny", lambda: core.bench_tiny_build(results)),
                ("storage", lambda: core.bench_storage(results, moto.url, bucket)),
                ("tracking", lambda: core.bench_tracking(results, local_tracking_uri(Path(work) / "ml"))),
                ("schema", lambda: core.bench_schema(results)),
                ("sandbox", lambda: sandbox.bench_sandbox(results)),
                ("rollout", lambda: runtime.bench_rollout(results)),
                ("grpo", lambda: grpo.bench_grpo(results)),
                ("smollm2", lambda: real_model.bench_smollm2(results)),
                ("async_grpo", lambda: async_grpo.bench_async_grpo(results)),
            ]
            only = set(sys.argv[1:])
            for name, fn in steps:
                if not only or name in only:
                    fn()
        finally:
            moto.stop()
    (home / "bench.json").write_text(json.dumps(results, indent=1))
    table = Table(title="agentrl benchmarks (ratio = ours / bare library, side by side; >1 is faster)")
    for col in ("benchmark", "value", "unit", "goal", "baseline", "ratio"):
        table.add_column(col, justify="left" if col == "benchmark" else "right")
    for name, r in results.items():
        table.add_row(name, *(str(r.get(k)) if r.get(k) is not None else "-" for k in
                              ("value", "unit", "goal", "baseline", "ratio")))
    Console().print(table)
    print(f"wrote {home / 'bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
