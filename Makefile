# The two commands of the README's Quick start, for a fresh clone:
#   make run    set everything up in .venv and serve the app on http://127.0.0.1:7860
#   make test   set up the test tools too, then lint and run the whole test suite (what CI runs)
# Also: make fast (the tests without the slow ones, ~2 min), make lint, make clean.
VENV ?= .venv
PY := $(VENV)/bin/python
export VENV

.PHONY: run test fast lint clean

run: $(VENV)/.ready
	$(PY) app.py

test: $(VENV)/.ready-dev lint
	$(PY) -m pytest -q

fast: $(VENV)/.ready-dev
	$(PY) -m pytest -q -m "not slow"

lint: $(VENV)/.ready-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

$(VENV)/.ready: requirements.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $@

$(VENV)/.ready-dev: $(VENV)/.ready requirements-dev.txt
	bash scripts/setup.sh --dev
	touch $@

clean:
	rm -rf $(VENV)
