# Two commands on a fresh machine: `make demo` and `make test` (both set up the venv first).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: gpu-wheels setup setup-hf5 setup-keras setup-oldest test-keras test-latest demo music test test-all test-fast test-oldest lint format browser bench bench-data bench-train bench-levers bench-vanilla \
	bench-vanilla-full bench-serve experiments clean

# pyproject.toml declares the ranges txl supports; the environments are installed from constraints/*.txt, which pin
# the exact versions the tests run with (the lock files: constraints/main.txt reproduces .venv).
PIP := python -m pip install --quiet --disable-pip-version-check

$(STAMP): pyproject.toml constraints/main.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/$(PIP) -c constraints/main.txt torch
	$(BIN)/$(PIP) -c constraints/main.txt -e '.[dev,bench,serve,lmeval,onnx,rl,triton,music,quant]'
	touch $(STAMP)

# The environment of the txl.hf suite (tests_hf): transformers 5, which cannot share one with the 4.46.3 above.
HF5_VENV  ?= .venv-hf5
HF5_BIN   := $(HF5_VENV)/bin
HF5_STAMP := $(HF5_VENV)/.installed-stamp

$(HF5_STAMP): pyproject.toml constraints/hf5.txt
	$(PYTHON) -m venv $(HF5_VENV)
	$(HF5_BIN)/$(PIP) -c constraints/hf5.txt torch
	$(HF5_BIN)/$(PIP) -c constraints/hf5.txt -e '.[hf-test]'
	touch $(HF5_STAMP)

# The oldest versions txl supports (pyproject.toml's floors: torch 2.9.1, numpy 2.0.2, ...; constraints/oldest.txt).
# PyPI's torch 2.9.1 for x86-64 is a CUDA build: ~7 GB with its NVIDIA libraries, ~3 minutes to install here.
# The environment of the txl.keras suite (tests_keras): Keras 3 with TensorFlow and JAX beside torch.
KERAS_VENV  ?= .venv-keras
KERAS_BIN   := $(KERAS_VENV)/bin
KERAS_STAMP := $(KERAS_VENV)/.installed-stamp

$(KERAS_STAMP): pyproject.toml constraints/keras.txt
	$(PYTHON) -m venv $(KERAS_VENV)
	$(KERAS_BIN)/$(PIP) -c constraints/keras.txt torch
	$(KERAS_BIN)/$(PIP) -c constraints/keras.txt -e '.[keras-test]'
	touch $(KERAS_STAMP)

OLD_VENV  ?= .venv-oldest
OLD_BIN   := $(OLD_VENV)/bin
OLD_STAMP := $(OLD_VENV)/.installed-stamp

$(OLD_STAMP): pyproject.toml constraints/oldest.txt
	$(PYTHON) -m venv $(OLD_VENV)
	$(OLD_BIN)/$(PIP) 'setuptools>=69,<81'  # (the build backend pyproject.toml names; the venv's own is older)
	$(OLD_BIN)/$(PIP) -c constraints/oldest.txt torch
	$(OLD_BIN)/$(PIP) -c constraints/oldest.txt -e '.[dev]'
	touch $(OLD_STAMP)

setup: $(STAMP)

setup-hf5: $(HF5_STAMP)

setup-keras: $(KERAS_STAMP)

setup-oldest: $(OLD_STAMP)

# The fast suite (< 3 minutes on 2 cores): the model against the reference, its paths and formats, changed models
# in every path, the fast paths' registry and measured choice, the data, the command line's errors, agents' memory,
# the packaging.
# `make test-oldest` runs it on the oldest supported versions.
FAST := tests/test_packaging.py tests/test_model_api.py tests/test_oracle_parity.py tests/test_adaptive.py \
	tests/test_attn_types.py tests/test_backends_exact.py tests/test_data_tokenizer.py tests/test_cli_errors.py \
	tests/test_rl_memory.py tests/test_changed_models.py tests/test_measured.py tests/test_registry.py \
	tests/test_compressive.py
# The tests run in parallel, one process per core (at most 4: each holds models and a native build), with pytest-xdist
# (tests/conftest.py gives each its share of the threads).
PARALLEL := -n auto --maxprocesses 4

test-fast: lint
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not slow" $(FAST)

test-oldest: setup-oldest
	$(OLD_BIN)/python -m pytest -q $(PARALLEL) -m "not slow" -p no:cacheprovider $(FAST)

demo: setup
	$(BIN)/python -m txl.demo

# Music (docs/music.md): Bach's chorales from music21's wheel rendered to MIDI, a REMI Transformer-XL trained on them
# (about 10 minutes on 2 cores), and a new 16-bar piece: runs/chorales/sample.mid and its piano roll sample.png.
music: setup
	$(BIN)/txl data get chorales --out data/chorales
	$(BIN)/txl train --config configs/chorales.yaml
	$(BIN)/txl generate --model runs/chorales --midi runs/chorales/sample.mid --bars 16 \
	  --piano_roll runs/chorales/sample.png --temperature 0.9 --top_k 20 --seed 1 --json true

lint: setup
	$(BIN)/ruff check src tests tests_hf tests_keras benchmarks experiments examples tools
	$(BIN)/ruff format --check src tests tests_hf tests_keras benchmarks experiments examples tools
	$(BIN)/lint-imports --no-cache  # the layers of docs/architecture.md (pyproject.toml: [tool.importlinter])

# The wheels a lent GPU machine lacks (its image holds torch and triton, not HF's TransfoXL 4.46.3 nor gymnasium and
# popgym): downloaded here into .whl/ (ignored by git) for its Python 3.12; a device call carries them (carry:
# [".whl", ".whl2"]) and benchmarks/gpu_suite.sh installs them first (HF's rows; the `rl` step's PPO iteration).
# txl's own pure-Python dependencies that the image lacks go to .whl2/ (benchmarks/gpu_e2e.sh, the `e2e` step).
GPU_WHEELS := transformers==4.46.3 tokenizers==0.20.3 huggingface_hub==0.26.5 gymnasium==1.4.0 popgym==1.0.7 \
	farama-notifications==0.0.6
GPU_WHEELS2 := jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 sacremoses==0.1.1
GPU_PIP := python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
gpu-wheels:
	$(GPU_PIP) -d .whl $(GPU_WHEELS)
	$(GPU_PIP) -d .whl2 $(GPU_WHEELS2)

# Headless Chromium and its driver (Debian packages) for the web page's browser test; needs apt-get (root).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    chromium chromium-driver; }

# `make test` skips the tests marked slow (processes: torchrun, signals, full disks, the browser), and runs the others
# in parallel; `make test-all` and CI (.ci/run: make test SLOW=1) then run the slow ones too, one at a time (they
# start processes of their own), the browser test included (it installs Chromium first). Then the txl.hf suite in its
# transformers-5 environment (it compares with 4.46.3 through the main one). The 15 slowest tests of the default
# suite are listed at the end.
test: lint $(if $(SLOW),browser,) setup-hf5 setup-keras
	$(BIN)/python -m pytest -q $(PARALLEL) --durations=15 -m "not slow"
	$(if $(SLOW),TXL_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q --durations=15 -m slow,)
	$(HF5_BIN)/python -m pytest -q -p no:cacheprovider tests_hf
	$(MAKE) test-keras

# txl.keras on each Keras backend (one pytest per backend: Keras reads KERAS_BACKEND once per process)
test-keras: setup-keras
	KERAS_BACKEND=jax $(KERAS_BIN)/python -m pytest -q -p no:cacheprovider $(PARALLEL) tests_keras
	KERAS_BACKEND=tensorflow $(KERAS_BIN)/python -m pytest -q -p no:cacheprovider $(PARALLEL) tests_keras
	KERAS_BACKEND=torch $(KERAS_BIN)/python -m pytest -q -p no:cacheprovider $(PARALLEL) tests_keras

test-all:
	$(MAKE) test SLOW=1

# The newest release of every integration inside pyproject.toml's ranges (transformers, peft, accelerate, keras, jax,
# tensorflow, miditok, torchrl, gymnasium...), no lock file: a leg whose newest versions are the lock file's says so
# (make test tested them); a newer one gets its own environment (.venv-latest-LEG) and its suite runs there. CI runs it.
test-latest: setup
	$(PYTHON) tools/test_latest.py

format: setup
	$(BIN)/ruff format src tests tests_hf tests_keras benchmarks experiments examples tools
	$(BIN)/ruff check --fix src tests tests_hf tests_keras benchmarks experiments examples tools

bench: setup
	$(BIN)/python benchmarks/model_speed.py --write docs/benchmarks.md
	$(BIN)/python benchmarks/train_speed.py --write docs/benchmarks.md
	$(BIN)/python benchmarks/levers.py --write docs/benchmarks.md
	$(BIN)/python benchmarks/eval_speed_vs_vanilla.py --quick --write docs/benchmarks.md
	$(BIN)/python benchmarks/serve_load.py --write docs/benchmarks.md

bench-train: setup
	$(BIN)/python benchmarks/train_speed.py --write docs/benchmarks.md

bench-levers: setup
	$(BIN)/python benchmarks/levers.py --write docs/benchmarks.md

bench-vanilla: setup
	$(BIN)/python benchmarks/eval_speed_vs_vanilla.py --quick --write docs/benchmarks.md

# Table 9 at the paper's attention lengths (800 to 3,800; about 10 minutes on 2 cores)
bench-vanilla-full: setup
	$(BIN)/python benchmarks/eval_speed_vs_vanilla.py --windows 2 --write docs/benchmarks.md

# The paper's experiments at CPU scale (docs/paper.md): recurrence (~8 minutes), Table 6 (~40 minutes) and the
# long-range corpus (~80 minutes; fetches sympy 1.14.0 with pip)
experiments: setup
	$(BIN)/python experiments/recurrence.py --steps 1500 --write docs/paper.md
	$(BIN)/python experiments/ablation.py --budget full --write docs/paper.md
	$(BIN)/python experiments/long_range.py --budget full --write docs/paper.md
	$(BIN)/python experiments/long_range_levers.py --write docs/paper.md

bench-serve: setup
	$(BIN)/python benchmarks/serve_load.py --write docs/benchmarks.md

bench-data: setup
	$(BIN)/python benchmarks/data_prep.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) $(HF5_VENV) $(KERAS_VENV) $(OLD_VENV) .venv-latest-* runs .pytest_cache .ruff_cache
