# Two entry points for a newcomer: `make dashboard` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: dashboard demo test test-gpu clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel first: a bare `torch` requirement would pull gigabytes of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,otlp]'
	touch $(STAMP)

dashboard: $(STAMP)
	$(PY) -m tui

demo: $(STAMP)
	$(PY) -m telemetry --preset tiny --workload mixed --duration 30

test: $(STAMP)
	$(PY) -m pytest -m "not gpu"

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
