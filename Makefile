# Everything runs on the CPU PJRT client; no TPU or GPU is needed.
export PJRT_DEVICE ?= CPU
export PYTHONUNBUFFERED = 1

# The Python to set up with: any that torch_xla 2.8.x and 2.9.0 ship wheels
# for (3.10 to 3.13; setup.py's python_requires says the same). 3.11 uses the
# venvs below; another gets its own, e.g. `make test PYTHON_VERSION=3.12`
# builds and uses .venv-py3.12 (.venv-2.8.1-py3.12 with TORCH_XLA=2.8.1).
PYTHON_VERSION ?= 3.11
PYTHON_BASE ?= python$(PYTHON_VERSION)

# The torch_xla release to set up and test against, with the torch release it
# was built for (torch_xla_patches/versions.py holds the same pairs). 2.9.0
# uses .venv; any other release gets a venv of its own, e.g.
# `make test TORCH_XLA=2.8.1` builds and uses .venv-2.8.1.
TORCH_XLA ?= 2.9.0
TORCH_FOR_2.9.0 := 2.9.0
TORCH_FOR_2.8.1 := 2.8.0
TORCH_FOR_2.8.0 := 2.8.0
TORCH := $(TORCH_FOR_$(TORCH_XLA))
# torchvision at the release built for each torch: upstream's test/dynamo
# (tools/run_upstream_tests.py) imports it.
TORCHVISION_FOR_2.9.0 := 0.24.0
TORCHVISION_FOR_2.8.0 := 0.23.0
TORCHVISION := $(TORCHVISION_FOR_$(TORCH))
ifeq ($(TORCH),)
$(error TORCH_XLA=$(TORCH_XLA) is not supported; use 2.9.0, 2.8.1 or 2.8.0)
endif
ifeq ($(TORCH_XLA),2.9.0)
VENV := .venv
else
VENV := .venv-$(TORCH_XLA)
endif
ifneq ($(PYTHON_VERSION),3.11)
ifeq ($(TORCH_XLA),2.9.0)
VENV := .venv-py$(PYTHON_VERSION)
else
VENV := $(VENV)-py$(PYTHON_VERSION)
endif
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test format format-check bench clean upstream-tests

setup: $(STAMP)

# setup.py allows every supported release; the exact pair is pinned here.
$(STAMP): setup.py torch_xla_patches/csrc/fast_path.cpp
	test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	$(PY) -m pip install --upgrade-strategy only-if-needed \
	  'torch==$(TORCH)' 'torch_xla==$(TORCH_XLA)' \
	  'torchvision==$(TORCHVISION)' -e '.[test,tools]'
	# The native fast path, built ahead of time (without a C++ compiler the
	# package runs its Python twins; see torch_xla_patches/native.py).
	-$(PY) -c 'import sys; from torch_xla_patches import native; sys.exit(native.main())'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/bench_warmup.py --demo
	$(PY) tools/bench_decode.py --demo --mesh --hf-generate
	$(PY) tools/bench_generation.py --demo
	$(PY) tools/bench_genserver.py --demo

# PYTEST_ARGS: e.g. test/test_patching.py, or -k name.
PYTEST_ARGS ?= test
# The suite runs on PYTEST_WORKERS processes (pytest-xdist), each taking a
# whole test file at a time, so a file's tests keep their order and their
# process. 2 matches CI's 2 cores; PYTEST_WORKERS=0 runs every test in
# pytest's own process (for a debugger, or one quick file).
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) \
	  --dist loadfile $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) tools/bench_dispatch.py

format: $(STAMP)
	$(PY) -m yapf -i -r torch_xla_patches test tools setup.py

format-check: $(STAMP)
	$(PY) -m yapf -d -r torch_xla_patches test tools setup.py

# pytorch/xla's test/dynamo without and with the patch, side by side.
# UPSTREAM_TESTS_ARGS: e.g. --rendered, --automatic-dynamic off, --files X.py
upstream-tests: $(STAMP)
	@test -n "$(XLA_SRC)" || { echo 'usage: make upstream-tests XLA_SRC=/path/to/pytorch-xla-checkout [TORCH_XLA=2.8.1]'; exit 2; }
	$(PY) tools/run_upstream_tests.py --xla-src $(XLA_SRC) $(UPSTREAM_TESTS_ARGS)

clean:
	rm -rf build *.egg-info .hypothesis
