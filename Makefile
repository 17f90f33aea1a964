# Two entry points for a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

VLLM_VENV := .vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed
# The vLLM releases the integration is tested against (aiokvo[vllm] pins the same range):
# 0.32 from its CPU build (the whole engine runs), 0.33 from its CUDA wheel installed
# without dependencies next to the CPU torch (its scheduler and connector run; docs/vllm.md).
VLLM_VERSION := 0.32.0
VLLM033_VENV := .vllm033-venv
VLLM033_STAMP := $(VLLM033_VENV)/.installed
VLLM033_VERSION := 0.33.0

.PHONY: demo test quick lint unit system-deps test-vllm bench bench-vllm bench-peer clean

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

# The Debian libraries Mooncake loads (the Mooncake tier's tests start a real cluster):
# installed with apt-get when running as root, otherwise named (scripts/system_deps.sh).
system-deps:
	bash scripts/system_deps.sh

unit: $(STAMP) system-deps
	$(BIN)/pytest -q

# The work loop's lane: the suite without the tests marked `system` (clusters,
# processes, real filesystems; tests/conftest.py enforces the marker), no lint,
# no vLLM venv. `make test` still runs everything.
quick: $(STAMP)
	$(BIN)/pytest -q -m "not system"

# vLLM's CPU build in its own venv (scripts/vllm_venv.sh): the integration tests, the
# engine-loop harness, the shadow check and vLLM's own offload tests run there, with
# this checkout on PYTHONPATH. AIOKVO_REQUIRE_VLLM makes a missing vLLM an error.
$(VLLM_STAMP): scripts/vllm_venv.sh
	VLLM_VERSION=$(VLLM_VERSION) bash scripts/vllm_venv.sh $(VLLM_VENV)

$(VLLM_VENV): $(VLLM_STAMP)

$(VLLM033_STAMP): scripts/vllm_venv.sh
	bash scripts/vllm_venv.sh $(VLLM033_VENV) $(VLLM033_VERSION)

$(VLLM033_VENV): $(VLLM033_STAMP)

# The whole suite on 0.32; on 0.33 all but the `vllm_llm` tests, which run a whole
# vllm.LLM and need a CPU build that 0.33 does not have (its scheduler and engine
# core tests do run).
test-vllm: $(VLLM_STAMP) $(VLLM033_STAMP)
	PYTHONPATH=$(CURDIR) AIOKVO_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q tests/integrations/vllm
	PYTHONPATH=$(CURDIR) AIOKVO_REQUIRE_VLLM=1 $(VLLM033_VENV)/bin/python -m pytest -q \
		-m "not vllm_llm" tests/integrations/vllm

test: lint unit test-vllm

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_manager.py
	$(BIN)/python benchmarks/bench_async.py
	$(BIN)/python benchmarks/bench_offloader.py
	$(BIN)/python benchmarks/bench_metrics.py
	$(BIN)/python benchmarks/bench_tiers.py

# Side by side with vLLM 0.32's manager, from the vLLM venv (not a dependency).
bench-peer: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/bench_manager.py --peer $(VLLM_VENV)/bin/python --repeat 3

# vLLM's scheduler driving its native offload spec and aiokvo's, in one run.
bench-vllm: $(VLLM_STAMP)
	PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python benchmarks/bench_vllm.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM033_VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
