# subnet_ext developer commands. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# transformers + safetensors + accelerate: the optional [hf] extra (--model hf:DIR, SDPTrainer); lightning:
# the [lightning] extra (SDPStrategy). Installed so CI tests them (tests/integrations/ fails without them).
DEPS := torch numpy ninja pybind11 setuptools wheel pytest hypothesis tqdm matplotlib scikit-learn transformers safetensors \
	"accelerate>=1.0,<2" "lightning>=2.4,<3"
# Real-architecture tests (tests/models/test_real_models.py): CPU wheels; torchvision 0.29 is the build for torch 2.14.
TEST_DEPS := torchvision timm
# The documentation (`make docs`, tests/project/test_docs.py): the [docs] extra.
DOCS_DEPS := sphinx myst-parser
export MAX_JOBS ?= 2

.PHONY: venv build test demo docs bench bench-e2e fuzz clean

$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(DEPS)
	$(PIP) install -q $(TEST_DEPS)
	$(PIP) install -q $(DOCS_DEPS)
	touch $@

venv: $(VENV)/.deps

# Builds the CPU kernels always and the CUDA kernels when torch has CUDA and nvcc is found
# (SUBNET_EXT_CUDA=0|1 forces either way). A file target: pip runs only when a kernel
# source, setup.py, pyproject.toml or the environment is newer than the last build (then
# ninja recompiles only what changed), so `make demo` / `make bench` twice build once.
CSRC := $(shell find csrc -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' \))
BUILD_STAMP := build/subnet_ext.stamp

$(BUILD_STAMP): $(VENV)/.deps $(CSRC) setup.py pyproject.toml
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@mkdir -p $(@D)
	touch $@

build: $(BUILD_STAMP)

test: build
	$(PY) -c "import subnet_ext, json; print(json.dumps(subnet_ext.build_info()))"
	$(PY) -m pytest -q tests

# 5 seeds x 5 variants x 400 steps: ~41 s per seed on 2 quiet cores, ~3.5 min in all.
DEMO_SEEDS ?= 5
demo: build
	$(PY) -m subnet_ext.cli.train compare --seeds $(DEMO_SEEDS)

# The documentation: docs/ (MyST pages) and the API reference from the docstrings, into
# docs/_build/html; every warning is an error. tests/project/test_docs.py runs the same build.
docs: build
	$(PY) -m sphinx -E -W --keep-going -b html -d docs/_build/doctrees docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html"

# Kernel microbenchmarks: builds bench/bin/ and writes bench/results/cpu.md (bench/README.md).
bench: build
	PY=$(PY) bash bench/build.sh
	PY=$(PY) bash bench/run_cpu.sh

# End-to-end step benchmark, two runs in interleaved rounds (bench/README.md): the rows
# with sharded shared parameters, with a profile of one step per row, into
# bench/results/e2e-shard-cpu.md; then the broad grid (llama tiny/small/medium, K = 2 and 4,
# DDP, FSDP2, every SDP variant and coverage, the overlap experiment) into
# bench/results/e2e-cpu.md.
# ~30-35 min on 2 quiet cores (bench/README.md).
E2E_SHARD := --models small --worlds 2,4 --coverages 2:0.5,4:0.25 --methods ddp,fsdp,sdp \
	--sdp-variants block-forward --shard-shared also --skip-overlap --rounds 9 --profile \
	--out bench/results/e2e-shard-cpu.md
E2E_GRID := --out bench/results/e2e-cpu.md
bench-e2e: build
	$(PY) bench/e2e.py $(E2E_SHARD)
	$(PY) bench/e2e.py $(E2E_GRID)

# Long fuzzing run, outside CI: >= 10,000 examples per fuzzed surface; writes bench/results/fuzz.md.
fuzz: build
	SUBNET_EXT_FUZZ_EXAMPLES=$${SUBNET_EXT_FUZZ_EXAMPLES:-10000} $(PY) bench/fuzz.py

# The suite against another supported torch release, in its own venv (.venv-torchX.Y, with
# a copy of the tree built against that torch): make test-torch TORCH=2.11.0. See .ci/test-torch.
TORCH ?=
.PHONY: test-torch
test-torch:
	@test -n "$(TORCH)" || { echo "make test-torch needs a torch release: make test-torch TORCH=2.11.0" >&2; exit 2; }
	PYTHON=$(PYTHON) bash .ci/test-torch $(TORCH)

# The study, outside CI (bench/study/, python -m bench.study): on nanoGPT's Tiny Shakespeare benchmark at its
# published CPU recipe (the file at ../shared/data/tinyshakespeare.txt or $$SUBNET_EXT_TINY_SHAKESPEARE): the
# recipe reproduced, DDP, FSDP2, checkpointing, stochastic depth, the smaller dense models and SDP (both levels,
# both regimes, C = 0.5 and 0.25), an 8-block model, and a bf16 memory measurement; writes docs/study-cpu.md,
# its plots and summary.json, and the generated blocks of README.md and docs/results.md (62 training runs of 2,000
# iterations, 4 to 22 minutes each on 2 cores: many hours, docs/status.md). `python -m bench.study --quick` is its 3-minute form (docs/study-cpu-quick.md; CI runs it).
.PHONY: study
study: build
	$(PY) -m bench.study

clean:
	rm -rf build bench/bin docs/_build *.egg-info subnet_ext/_C*.so subnet_ext/_build_info.py
