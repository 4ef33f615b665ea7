# Two entry points for a newcomer: `make dashboard` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: dashboard demo test test-gpu clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so that the project's loose `torch>=2.4` never picks another one. Where a
	# local CPU wheel is staged (this project's machines and CI) that is what pip takes; from PyPI
	# alone it is the CUDA build (several GB, and it runs on the CPU as well). For the small
	# CPU-only build, install torch==2.13.0 from PyTorch's CPU wheel index into .venv first.
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
