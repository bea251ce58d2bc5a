# The README's commands. Each sets up what it needs first (idempotent): serve and chat the serve set, test and test-fast the test set too.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
# The markers are described in pyproject.toml.
FAST_TESTS := not server and not notebook and not interpreter and not slow

.PHONY: setup setup-serve serve chat test test-fast
SETUP_SCRIPTS := pyproject.toml scripts/setup.sh scripts/requirements_of.py scripts/torch_triton_pin.py

# Two sets, one stamp each (scripts/setup.sh): `make serve` installs what serving needs; `make test`
# adds the test tools and optional backends on top. A changed pyproject.toml redoes both, in order.
$(VENV)/.serve-installed: $(SETUP_SCRIPTS)
	bash scripts/setup.sh $(VENV) serve
	touch $@

$(VENV)/.test-installed: $(VENV)/.serve-installed $(SETUP_SCRIPTS)
	bash scripts/setup.sh $(VENV) test
	touch $@

setup-serve: $(VENV)/.serve-installed
setup: $(VENV)/.test-installed

# make serve HOST=0.0.0.0 PORT=8080 SERVE_ARGS="--max-num-seqs 8": any flag of `tinyserve serve --help`.
# Ctrl-C drains the server and ends make with its status (scripts/foreground.py says how).
serve: setup-serve
	@$(PYTHON) scripts/foreground.py $(VENV)/bin/tinyserve serve --trace --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# make chat PORT=8080: `tinyserve chat` with the server `make serve` (the same HOST and PORT) runs.
chat: setup-serve
	@TINYSERVE_URL=http://$(if $(filter 0.0.0.0,$(HOST)),127.0.0.1,$(HOST)):$(PORT)/v1 $(VENV)/bin/tinyserve chat

# Two tests at a time, each file's in one worker (its module-scoped server shared by its tests); TEST_WORKERS=0: one.
# The files go out in the conftest's order, longest first, not pytest-xdist's (most tests first).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	$(PYTHON) -m pytest -q $(XDIST)

# Scheduler, KV cache, sampler, detokenizer, protocol, model parity on tiny checkpoints, ...:
# everything but real servers, notebooks, the Triton interpreter and the other slow tests.
test-fast: setup
	$(PYTHON) -m pytest -q $(XDIST) -m "$(FAST_TESTS)"
