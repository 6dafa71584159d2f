# Entry points for people and CI. Every target that needs the environment runs setup first,
# which is quick when everything is already installed.
.PHONY: setup model up test lint

VENV := .venv
# three workers (pytest-xdist), each taking whole files: module-scoped clusters start once. CI has two cores, but
# much of a worker's time is waiting (process starts, heartbeats, timeouts the fault tests wait out): on a fresh
# clone, 2 cores, three workers took 11:41 where two took 15:08 (2026-12-04; the CPU still 21% idle with three)
# --no-loadscope-reorder: keep tests/conftest.py's longest-first order (xdist would order files by test count);
# --durations: CI's log names the slowest tests (where the suite's time goes)
PYTEST_FLAGS ?= -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder --durations=25

setup:
	bash scripts/setup.sh

# Converts the built-in model into the local cache once (prints its folder).
model: setup
	$(VENV)/bin/tierserve model fetch

up: model
	$(VENV)/bin/tierserve up

test: model
	$(VENV)/bin/pytest -m 'not gpu and not rdma' $(PYTEST_FLAGS)

lint: setup
	$(VENV)/bin/ruff check
