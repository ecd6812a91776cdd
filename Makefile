# Two commands do all the set-up: `make demo` and `make test` (`make docs` builds the docs).
# Each builds .venv if it is missing. torch is pinned to the CPU wheel that lies on this
# machine's disk (2.13.0) unless some torch is already importable, so pip never pulls a
# multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tandem-installed
TORCH  ?= torch==2.13.0

.PHONY: demo test test-all install clean bench gpu-check docs docs-extra

# pip --no-compile, then compileall: bytecode on all cores instead of pip's one (about 20 s
# less). A file that does not compile (torch ships a test file in Python 3.12's syntax) only
# goes without bytecode, as it would under pip: compileall's status is not make's error, and
# the line says so in words instead of make's "Error 1 (ignored)"
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/python -m pip install -q --no-compile "$(TORCH)"
	$(BIN)/python -m pip install -q --no-compile -e '.[dev]'
	@echo "$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib"
	@$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || echo "  (bytecode: a few files" \
		"in $(VENV)/lib are for another Python version and stay uncompiled, as under pip)"
	touch $(STAMP)

install: $(STAMP)

# three pytest workers (pytest-xdist) on the 2 cores, tests dealt out one by one: the
# multi-process tests wait on their processes' start and their timeouts, which a third worker
# fills (they are stressed beside two busy loops, scripts/stress_mp.sh, a harder load); grouping
# them by module, so that a module-scoped fixture is built once, measured 100 s slower (the last
# modules ran alone); TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 3

# bytecode for src and tests first: with PYTHONDONTWRITEBYTECODE set (as on this machine) each
# of the suite's hundreds of interpreters would compile tandem again (this takes under 1 s)
# make test leaves the extended tier out (tests/conftest.py's EXTENDED: second routes and
# tools); make test-all is the same run with it in
TEST_SELECT ?= -m "not extended"
test: $(STAMP) docs-extra
	-$(BIN)/python -m compileall -qq -j 0 src tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(TEST_SELECT)

test-all: TEST_SELECT =
test-all: test

# The documentation site: Sphinx with MyST Markdown pages and the furo theme, chosen over MkDocs
# Material because the docstrings are reStructuredText with Sphinx cross-references, which
# autodoc renders as they are (docs/README.md says more). The docs extra is installed into
# .venv when it is missing (also for `make test`: tests/integration/cli/test_docs.py builds
# the site). -W: every warning is an error; docs/_ext/tandem_reference.py writes the CLI page
# from the parsers.
docs-extra: $(STAMP)
	@$(BIN)/python -c "import sphinx, myst_parser, furo" 2>/dev/null || \
		$(BIN)/python -m pip install -q --no-compile -e '.[docs]'

docs: docs-extra
	$(BIN)/python -m sphinx -b html -W --keep-going -q docs docs/_build/html
	@echo "docs/_build/html/index.html"

demo: $(STAMP)
	$(BIN)/tandem train --arch cifar_resnet20 --data digits --strategy dp --devices cpu:2 \
		--epochs 8 --out runs/demo --overwrite
	@echo "tandem is in $(BIN), not on your PATH: run 'source $(BIN)/activate' (then 'tandem ...'), or call '$(BIN)/tandem ...'"

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_overhead.py

# on a GPU machine; needs no .venv (python3 and PYTHONPATH=src), see scripts/gpu_check.sh
gpu-check:
	scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs docs/_build docs/_generated
