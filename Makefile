# subnet_ext developer commands. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEPS := torch numpy ninja pybind11 setuptools wheel pytest hypothesis tqdm matplotlib scikit-learn
export MAX_JOBS ?= 2

.PHONY: venv build test demo bench bench-e2e fuzz clean

$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(DEPS)
	touch $@

venv: $(VENV)/.deps

# Builds the CPU kernels always and the CUDA kernels when torch has CUDA and nvcc is found
# (SUBNET_EXT_CUDA=0|1 forces either way). ninja rebuilds only what changed.
build: venv
	$(PIP) install -q --no-build-isolation --no-deps -e .

test: build
	$(PY) -c "import subnet_ext, json; print(json.dumps(subnet_ext.build_info()))"
	$(PY) -m pytest -q tests

demo: build
	$(PY) -m subnet_ext.cli.train compare

bench: build
	bash bench/build.sh
	bash bench/run_cpu.sh

bench-e2e: build
	$(PY) bench/e2e.py

# Long fuzzing run, outside CI: >= 10,000 examples per fuzzed surface; writes bench/results/fuzz.md.
fuzz: build
	SUBNET_EXT_FUZZ_EXAMPLES=$${SUBNET_EXT_FUZZ_EXAMPLES:-10000} $(PY) bench/fuzz.py

clean:
	rm -rf build bench/bin *.egg-info subnet_ext/_C*.so subnet_ext/_build_info.py
