# labkit: `make lab` sets everything up and starts JupyterLab on notebooks/; `make test` sets up and tests.
# The set-up runs once: a stamp in the venv remembers it until requirements.txt, pyproject.toml or binder/apt.txt change.
# `make test` also installs the test suite's Debian packages (tests/apt.txt: Chromium) before it runs pytest.
# `make test-fast` runs the tests that start no process (ranks, kernels, browsers): the lane for daily work.
#   make lab PORT=8899 ARGS="--no-browser"    make test PYTEST_ARGS="-x tests/test_setup.py"

PYTHON      ?= $(shell command -v python3.11 || command -v python3)
VENV        ?= .venv
PORT        ?= 8888
ARGS        ?=
PYTEST_ARGS ?=
BENCH_ARGS  ?=

PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.labkit-setup
# torch goes in first, alone, at the exact pin: asked for later, through another package, pip would pick a
# different (multi-GB CUDA) build. The pin has one home, the first line of requirements.txt.
TORCH  := $(shell sed -n 's/^\(torch==[^ ;#]*\).*/\1/p' requirements.txt)
# Jupyter refuses to start as root unless told; containers and CI machines often run as root.
ROOT   := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: lab test test-fast bench lint setup prebuild doctor clean

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir notebooks --port $(PORT) $(ROOT) $(ARGS)

test: tests/apt.txt setup
	scripts/install-debian-packages binder/apt.txt tests/apt.txt
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast lane: every test not marked `slow` (tests/conftest.py says which are).
test-fast: tests/apt.txt setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Side-by-side engine benchmarks (not part of the test suite): medians and ratios into benchmarks/results.md.
bench: benchmarks/run_all.py setup
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# The student release (`labkit release --student`) has neither folder: say so before any set-up starts.
tests/apt.txt benchmarks/run_all.py:
	@echo "make: this copy has no $(@D)/: the student release of the course leaves the test suite and the benchmarks out" >&2; exit 2

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Debian packages first (binder/apt.txt: libaio for DeepSpeed's NVMe offload; only a warning when this user
# cannot install them), so that the prebuild finds them.
$(STAMP): requirements.txt pyproject.toml binder/apt.txt | $(PY)
	scripts/install-debian-packages --optional binder/apt.txt
	$(PIP) install "$(TORCH)"
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps -e .
	$(PY) -m labkit.prebuild
	$(PY) -m ipykernel install --sys-prefix --name labkit --display-name "labkit (Python $$($(PY) -c 'import sys; print(*sys.version_info[:2], sep=".")'))"
	touch $@

# Rebuild DeepSpeed's CPU ops (after an interrupted build, or a torch upgrade); check the machine.
prebuild: setup
	$(PY) -m labkit.prebuild

doctor: setup
	$(VENV)/bin/labkit doctor

# Forget the set-up (the next make redoes it) and the caches; the venv itself stays.
clean:
	rm -f $(STAMP)
	rm -rf .pytest_cache .ruff_cache
