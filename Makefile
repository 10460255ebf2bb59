# Everything runs on the CPU PJRT client; no TPU or GPU is needed.
export PJRT_DEVICE ?= CPU
export PYTHONUNBUFFERED = 1

PYTHON_BASE ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test format format-check bench clean

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	$(PY) -m pip install --upgrade-strategy only-if-needed -e '.[test]'
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

clean:
	rm -rf build *.egg-info .hypothesis
