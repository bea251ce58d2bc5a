# The two commands of the README. Both set everything up first (idempotent).
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: setup serve test

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/tinyserve serve --trace

test: setup
	$(PYTHON) -m pytest -q
