# From a fresh clone, two commands (README "Install"):
#   make devnet   set up .venv if needed, then run the devnet on the shared TinyStories model
#   make test     set up .venv if needed, then run the whole test suite (what CI runs)
# Setting up is exactly README "Install": a venv, torch==2.13.0 (the CPU wheel), then the
# package with its transformers and test extras; it runs again when pyproject.toml changes.
# Extra arguments: make devnet ARGS="--perturb kill-relay", make test ARGS="-m 'not slow'".

VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
ARGS ?=

.PHONY: install devnet test

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[transformers,test]"
	touch $@

devnet: $(INSTALLED)
	$(BIN)/ps-node devnet $(ARGS)

test: $(INSTALLED)
	$(BIN)/python -m pytest -q $(ARGS)
