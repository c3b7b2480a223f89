# Two entry points for a new user (see README):
#   make demo   set everything up, plan the bank-FAQ job, autotune a small GPT on this CPU
#               with real probes, then train that plan for real with the runner
#   make test   set everything up and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[cpu,test]"
	touch $@

demo: setup
	$(BIN)/planner optimize --budget 12000
	$(BIN)/planner optimize --spec planner/specs/cpu_demo.toml --probes 6
	$(BIN)/runner execute plans/cpu_demo.toml

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs .cache
