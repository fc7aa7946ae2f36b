# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# Two supported stacks, picked with STACK= (each has its own virtual environment):
#   current (default): Python 3.12, torch 2.14.1, megatron-core 0.19.2   -> .venv
#   legacy:            Python 3.11, torch 2.13.0 (CPU build), megatron-core 0.16.1 -> .venv-legacy
STACK ?= current
ifeq ($(STACK),current)
PY_VERSION := 3.12
VENV ?= .venv
LOCK := requirements.lock
else ifeq ($(STACK),legacy)
PY_VERSION := 3.11
VENV ?= .venv-legacy
LOCK := requirements-legacy.lock
else
$(error STACK=$(STACK) is not a supported stack: use STACK=current (Python 3.12, megatron-core 0.19.2) or STACK=legacy (Python 3.11, megatron-core 0.16.1))
endif
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-fast lint docs bench clean

setup: $(STAMP)

# The stamp depends on the pins, so editing them re-installs; an existing venv is reused when its
# Python is the stack's (one made for another version is rebuilt, never silently mixed).
$(STAMP): pyproject.toml $(LOCK)
	@PY="$${PYTHON:-$$(scripts/find_python.sh $(PY_VERSION))}" || exit 1; \
	if ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != tuple(map(int, "$(PY_VERSION)".split("."))))' 2>/dev/null; then \
		echo "creating $(VENV) with $$PY (STACK=$(STACK))"; rm -rf $(VENV); "$$PY" -m venv $(VENV) || exit 1; \
	fi
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23"
	$(BIN)/python -m pip install --quiet -c $(LOCK) -e ".[dev,docs]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The inner loop: every test that starts no process (no train.py, no ranks), a couple of minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not launches" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint Dockerfile
	$(BIN)/python -m recipe.config_reference --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $$(mktemp -d)

# The docs site (mkdocs, material theme) into site/; --strict: a broken link or a page missing
# from the navigation fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python benchmarks/preprocess.py

clean:
	rm -rf .venv .venv-legacy outputs multirun .pytest_cache .hypothesis site
