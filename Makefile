# Two entry points; each sets up everything it needs on a fresh machine (a virtualenv in .venv).
#   make demo   - the HySparse walk-through on the embedded default (reference backend without a GPU)
#   make test   - the test suite (CPU tests + compile checks for sm_90a and sm_100a; GPU suites skip)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)

.PHONY: demo test venv clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Keep an existing paddlepaddle(-gpu); install the CPU wheel only when no Paddle is importable.
	$(PY) -c "import paddle" 2>/dev/null || $(PY) -m pip install -q "paddlepaddle==3.3.1"
	$(PY) -m pip install -q -e ".[test,demo]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m paddle_fa4 demo

test: $(STAMP)
	$(PY) -m pytest tests -q -ra $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
