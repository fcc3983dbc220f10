# Two commands on a fresh machine: `make demo` and `make test` (both set up the venv first).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo test test-all lint format bench bench-data bench-train bench-levers bench-vanilla clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python -m txl.demo

lint: setup
	$(BIN)/ruff check src tests benchmarks experiments
	$(BIN)/ruff format --check src tests benchmarks experiments

# `make test` skips the tests marked slow (processes: torchrun, signals, full disks); `make test-all` and CI
# (.ci/run: make test SLOW=1) run every test.
test: lint
	$(BIN)/python -m pytest -q $(if $(SLOW),,-m "not slow")

test-all:
	$(MAKE) test SLOW=1

format: setup
	$(BIN)/ruff format src tests benchmarks experiments
	$(BIN)/ruff check --fix src tests benchmarks experiments

bench: setup
	$(BIN)/python benchmarks/model_speed.py --write docs/benchmarks.md
	$(BIN)/python benchmarks/train_speed.py --write docs/benchmarks.md
	$(BIN)/python benchmarks/levers.py --write docs/benchmarks.md
	$(BIN)/python benchmarks/eval_speed_vs_vanilla.py --quick --write docs/benchmarks.md

bench-train: setup
	$(BIN)/python benchmarks/train_speed.py --write docs/benchmarks.md

bench-levers: setup
	$(BIN)/python benchmarks/levers.py --write docs/benchmarks.md

bench-vanilla: setup
	$(BIN)/python benchmarks/eval_speed_vs_vanilla.py --quick --write docs/benchmarks.md

bench-data: setup
	$(BIN)/python benchmarks/data_prep.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
