# Two entry points; each sets up everything it needs on a fresh machine (a virtualenv in .venv).
#   make demo   - the HySparse walk-through on the embedded default (reference backend without a GPU)
#   make decode-demo - a paged-cache decode loop: dense + block_logit, HySparse and H2O sparse decode
#   make test   - the test suite (CPU tests + compile checks for sm_90a and sm_100a; GPU suites skip)
#   make check ARCH=sm_100a [KERNEL=attention_fwd] [CHECK_ARGS=--full] - compile-check kernels with the venv's
#                   python (python -m cute_kernels.check; no GPU needed)
#   make check-cu13 - the default compile matrices of sm_90a, sm_100a and sm_103a under the DSL's CUDA 13 build
#                     (CI runs it after make test)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)
ARCH   ?= sm_100a

.PHONY: demo decode-demo test venv clean check check-cu13

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

decode-demo: $(STAMP)
	$(PY) -m paddle_fa4 decode-demo

test: $(STAMP)
	$(PY) -m pytest tests -q -ra $(PYTEST_ARGS)

check: $(STAMP)
	$(PY) -m cute_kernels.check --arch $(ARCH) $(if $(KERNEL),--kernel $(KERNEL)) $(CHECK_ARGS)

# The compile check under the DSL's CUDA 13 build (its own venv): its ptxas allocates registers unlike the CUDA 12
# build the tests compile with, and a GPU with a CUDA 13 driver runs it (README, "Checking the kernels").
check-cu13:
	test -x .venv-cu13/bin/python || $(PYTHON) -m venv .venv-cu13
	.venv-cu13/bin/python -m pip install -q "nvidia-cutlass-dsl[cu13]==4.8.1" "apache-tvm-ffi>=0.1.11,<0.2" numpy
	CUTE_KERNELS_CHECK_DSL_CUDA=13 .venv-cu13/bin/python -m cute_kernels.check --arch sm_90a
	CUTE_KERNELS_CHECK_DSL_CUDA=13 .venv-cu13/bin/python -m cute_kernels.check --arch sm_100a
	CUTE_KERNELS_CHECK_DSL_CUDA=13 .venv-cu13/bin/python -m cute_kernels.check --arch sm_103a

clean:
	rm -rf $(VENV) build *.egg-info
