# Two entry points (README): `make run` (the main job) and `make test` (the test suite); `make coverage`
# runs the suite under coverage, ranks included (docs/testing.md).
# Each creates its own virtual environment on first use. torch is pinned to 2.13.0, which pip takes
# from this machine's disk as the CPU build; the package's own `torch>=2.11` is then already satisfied,
# so no CUDA build is ever downloaded here.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: run test coverage setup clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[full,test,hf]"
	touch $@

setup: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/modelpar train

# the whole suite runs as its two tiers side by side (tests/run_tiers.sh); with PYTEST_ARGS (a file,
# -k, -m ...) one ordinary pytest session runs instead
test: $(VENV)/.installed
ifeq ($(strip $(PYTEST_ARGS)),)
	PY=$(PY) bash tests/run_tiers.sh
else
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)
endif

# the whole suite under coverage, ranks included (tests/run_coverage.sh, docs/testing.md "Coverage");
# coverage is not a project dependency: this target installs it into the virtual environment
coverage: $(VENV)/.installed
	$(PY) -m pip install -q "coverage>=7.10"
	PY=$(PY) bash tests/run_coverage.sh $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs parity-report.md .coverage .coverage.* coverage-report
