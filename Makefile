# Two entry points for a new user (README.md):
#   make demo   set everything up, plan the bank-FAQ job, autotune a small GPT on this CPU
#               with real probes, then train that plan for real with the runner
#   make test   set everything up, lint, build the manual and run the test suite
# What the demo leaves on this machine (calibration, probe results, caches) goes to the user
# data directory (~/.local/share/gptplan, or $GPTPLAN_DATA_DIR), never into the checkout; the
# tests run against their own, so `make demo` then `make test` on one checkout passes.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# pip's own output (and the warnings a machine's pip configuration may print) goes here; the
# last lines are shown if an install fails
PIPLOG := $(VENV)/pip.log
PIP    := $(BIN)/python -m pip --quiet
PIPFAIL := { grep -v "is ignored: it is neither" $(PIPLOG) | tail -n 30; echo "pip failed; log: $(PIPLOG)"; exit 1; }

.PHONY: setup demo test lint docs bench clean

setup: $(VENV)/.installed $(VENV)/.device

# The rehearsal device (docs/device.md): a Paddle plugin compiled against the installed wheel.
# Without a compiler setup goes on and says which rehearsals are then unavailable.
DEVICE_SRC := $(wildcard runner/device/src/*.cc runner/device/src/*.h)
$(VENV)/.device: $(VENV)/.installed $(DEVICE_SRC)
	@echo "building the rehearsal device (runner/device, about 1 min)"
	@$(BIN)/python -m runner.device build && touch $@ || true

$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "setting up $(VENV) with the versions pinned in constraints.txt (1-3 min; pip's output: $(PIPLOG))"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) install --upgrade pip >>$(PIPLOG) 2>&1 || $(PIPFAIL)
	@$(PIP) install -c constraints.txt -e ".[cpu,test]" >>$(PIPLOG) 2>&1 || $(PIPFAIL)
	@touch $@

# The optional `cloud` extra (SkyPilot) for the tests that check the emitted task YAML
$(VENV)/.cloud: $(VENV)/.installed
	@echo "installing the cloud extra (SkyPilot, to validate task YAML; pip's output: $(PIPLOG))"
	@$(PIP) install -c constraints.txt -e ".[cpu,test,cloud]" >>$(PIPLOG) 2>&1 || $(PIPFAIL)
	@touch $@

demo: setup
	$(BIN)/planner optimize --budget 12000
	$(BIN)/planner launch-file plans/bank_faq.toml
	$(BIN)/planner optimize --spec planner/specs/cpu_demo.toml --probes 6
	$(BIN)/runner execute plans/cpu_demo.toml
	$(BIN)/runner generate runs/cpu_demo --prompt "这个手机" --max-new-tokens 24 --min-new-tokens 16

# Two pytest-xdist workers, a test module at a time (its fixtures run once; tests/conftest.py
# hands out the longest modules first). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: setup $(VENV)/.cloud lint docs
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# ruff (lint + format check) over the tree, mypy over gptplan, runner and planner (pyproject.toml)
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The manual: docs/ built with MkDocs into site/ (git-ignored); --strict fails on a broken link,
# a missing anchor or a page left out of mkdocs.yml's nav
docs: setup
	$(BIN)/mkdocs build --strict --quiet

clean:
	rm -rf runs .cache site
