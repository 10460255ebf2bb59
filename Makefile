# Everything runs on the CPU PJRT client; no TPU or GPU is needed.
export PJRT_DEVICE ?= CPU
export PYTHONUNBUFFERED = 1

PYTHON_BASE ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test format format-check bench clean upstream-tests

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	$(PY) -m pip install --upgrade-strategy only-if-needed -e '.[test,tools]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/bench_warmup.py --demo

test: $(STAMP)
	$(PY) -m pytest test -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) tools/bench_dispatch.py

format: $(STAMP)
	$(PY) -m yapf -i -r torch_xla_patches test tools setup.py

format-check: $(STAMP)
	$(PY) -m yapf -d -r torch_xla_patches test tools setup.py

# pytorch/xla's test/dynamo without and with the patch, side by side.
# UPSTREAM_TESTS_ARGS: e.g. --rendered, --automatic-dynamic off, --files X.py
upstream-tests: $(STAMP)
	@test -n "$(XLA_SRC)" || { echo 'usage: make upstream-tests XLA_SRC=/path/to/pytorch-xla-checkout'; exit 2; }
	$(PY) tools/run_upstream_tests.py --xla-src $(XLA_SRC) $(UPSTREAM_TESTS_ARGS)

clean:
	rm -rf build *.egg-info .hypothesis
