# The README's commands. Each sets everything up first (idempotent).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
# The markers are described in pyproject.toml.
FAST_TESTS := not server and not notebook and not interpreter and not slow

.PHONY: setup serve test test-fast

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

setup: $(VENV)/.installed

# make serve HOST=0.0.0.0 PORT=8080 SERVE_ARGS="--max-num-seqs 8": any flag of `tinyserve serve --help`.
# Ctrl-C drains the server and ends make with its status (scripts/foreground.py says how).
serve: setup
	@$(PYTHON) scripts/foreground.py $(VENV)/bin/tinyserve serve --trace --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: setup
	$(PYTHON) -m pytest -q

# Scheduler, KV cache, sampler, detokenizer, protocol, model parity on tiny checkpoints, ...:
# everything but real servers, notebooks, the Triton interpreter and the other slow tests.
test-fast: setup
	$(PYTHON) -m pytest -q -m "$(FAST_TESTS)"
