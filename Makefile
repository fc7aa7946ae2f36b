# Two commands do all set-up on a fresh machine: `make train` and `make test`.
# Two supported stacks, picked with STACK= (each has its own virtual environment):
#   current (default): Python 3.12, torch 2.14.1, megatron-core 0.19.2   -> .venv
#   legacy:            Python 3.11, torch 2.13.0 (CPU build), megatron-core 0.16.1 -> .venv-legacy
# and a CPU stand-in of the bare GPU image (docs/gpu.md, "The GPU kit"):
#   image:             Python 3.12, torch 2.11.0 and the image's packages (requirements-image.lock),
#                      megatron-core, Hydra and datasets from the GPU kit      -> .venv-image
STACK ?= current
ifeq ($(STACK),current)
PY_VERSION := 3.12
VENV ?= .venv
LOCK := requirements.lock
else ifeq ($(STACK),legacy)
PY_VERSION := 3.11
VENV ?= .venv-legacy
LOCK := requirements-legacy.lock
else ifeq ($(STACK),image)
PY_VERSION := 3.12
VENV ?= .venv-image
LOCK := requirements-image.lock
else
$(error STACK=$(STACK) is not a supported stack: use STACK=current (Python 3.12, megatron-core 0.19.2), STACK=legacy (Python 3.11, megatron-core 0.16.1) or STACK=image (the GPU image's stand-in: Python 3.12, torch 2.11.0, the GPU kit))
endif
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ifeq ($(STACK),image)
# Only the lock: the image's torch and packages. megatron-core, Hydra and datasets come from the
# kit (make kit), never from pyproject.toml, whose torch pin is another version.
INSTALL := -r $(LOCK)
STAMP_DEPS := $(LOCK)
else
INSTALL := -c $(LOCK) -e ".[dev,docs]"
STAMP_DEPS := pyproject.toml $(LOCK)
endif

.PHONY: setup kit kit-fetch train test test-fast lint docs bench conventions clean

setup: $(STAMP)

# The stamp depends on the pins, so editing them re-installs; an existing venv is reused when its
# Python is the stack's (one made for another version is rebuilt, never silently mixed).
$(STAMP): $(STAMP_DEPS)
	@PY="$${PYTHON:-$$(scripts/find_python.sh $(PY_VERSION))}" || exit 1; \
	if ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != tuple(map(int, "$(PY_VERSION)".split("."))))' 2>/dev/null; then \
		echo "creating $(VENV) with $$PY (STACK=$(STACK))"; rm -rf $(VENV); "$$PY" -m venv $(VENV) || exit 1; \
	fi
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23"
	$(BIN)/python -m pip install --quiet $(INSTALL)
	touch $(STAMP)

ifeq ($(STACK),image)
KIT := $(VENV)/gpu_kit
KIT_SITE := $(VENV)/kit-site
RUN := PYTHONPATH=$(CURDIR)/$(KIT_SITE):$(CURDIR) $(BIN)/python
# The tests an image runs: every test that starts no process (those that need a dev-only tool,
# hadolint or the submitit launchers, skip there with the reason), less the config composition
# of test_config.py and test_docs.py (Hydra and omegaconf only, at the current stack's pins: the
# same outcome there; 18 s). Keeps CI's image stage under 4 minutes; docs/testing.md.
IMAGE_TESTS ?= -m "not launches" --ignore=tests/test_config.py --ignore=tests/test_docs.py

# The GPU kit as on the GPU machine: fetched once into $(KIT) (reused after), installed afresh.
# kit-fetch is the download alone (the network part), which CI overlaps with the other stages.
kit-fetch: $(STAMP)
	PYTHON=$(BIN)/python scripts/gpu_kit.sh fetch $(KIT)

kit: kit-fetch
	rm -rf $(KIT_SITE)
	PYTHON=$(BIN)/python scripts/gpu_kit.sh install $(KIT_SITE) $(KIT)

train: kit
	$(RUN) train.py $(ARGS)

# Smoke runs (each must exit 0 and print its final loss), then the tests.
test: kit
	@for args in "trainer.max_steps=3" "cp=2 mtp=on trainer.max_steps=3"; do \
		echo "== smoke: python train.py $$args logger.wandb.mode=disabled"; \
		$(RUN) train.py $$args logger.wandb.mode=disabled >$(VENV)/smoke.log 2>&1 \
			|| { cat $(VENV)/smoke.log; echo "smoke run failed: train.py $$args"; exit 1; }; \
		grep -E "^  final_(eval_)?lm_loss: [0-9.]+$$" $(VENV)/smoke.log \
			|| { cat $(VENV)/smoke.log; echo "no final loss: train.py $$args"; exit 1; }; \
	done
	$(RUN) -m pytest $(IMAGE_TESTS) -W ignore::SyntaxWarning $(PYTEST_ARGS)
else
kit kit-fetch:
	@echo "make $@ is for STACK=image; the GPU kit itself: scripts/gpu_kit.sh fetch" >&2; exit 2

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
endif

# The inner loop: every test that starts no process (no train.py, no ranks), a couple of minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not launches" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint Dockerfile
	$(BIN)/python -m recipe.config.reference --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $$(mktemp -d)

# The docs site (mkdocs, material theme) into site/; --strict: a broken link or a page missing
# from the navigation fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python benchmarks/preprocess.py

# The conventions table (docs/conventions.md): five sweeps, ~25 min on 2 CPU cores.
conventions: $(STAMP)
	PYTHON=$(BIN)/python scripts/conventions.sh outputs/conventions --write-docs

clean:
	rm -rf .venv .venv-legacy .venv-image gpu_kit outputs multirun .pytest_cache .hypothesis site
