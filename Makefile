# The README's commands. Each sets everything up first (idempotent).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# The markers are described in pyproject.toml.
FAST_TESTS := not server and not notebook and not interpreter and not slow

.PHONY: setup serve test test-fast

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/tinyserve serve --trace

test: setup
	$(PYTHON) -m pytest -q

# Scheduler, KV cache, sampler, detokenizer, protocol, model parity on tiny checkpoints, ...:
# everything but real servers, notebooks, the Triton interpreter and the other slow tests.
test-fast: setup
	$(PYTHON) -m pytest -q -m "$(FAST_TESTS)"
