# Two commands on a fresh machine: `make demo` and `make test`. Both do all set-up first (idempotent).
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup setup-containers demo lint test test-fast bench clean-state

setup:
	@VENV=$(VENV) packaging/setup.sh

setup-containers: setup
	@packaging/containers/setup.sh install all

demo: setup
	$(VENV)/bin/coldsnap demo

# The floors (import-linter contracts in pyproject.toml), ruff and the type checker (mypy, pyproject.toml's
# [tool.mypy] files), before the suite: all fail fast.
lint: setup
	$(VENV)/bin/ruff check coldsnap coldsnap_reference coldsnap_bench coldsnap_sparkrun tests packaging
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast: lint
	$(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/coldsnap bench --samples 20

clean-state:
	-for n in $$(ip netns list | awk '/^coldsnap-/{print $$1}'); do ip netns del $$n; done
	rm -rf /run/coldsnap
