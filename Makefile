# Two entry points, each doing all set-up from a fresh clone:
#   make demo   -- virtual environment + package, then the main job (normkit lab)
#   make test   -- virtual environment + package + dev tools, then the test suite
#
# TORCH pins the CPU build that lies on this machine's disk; elsewhere, override it
# (e.g. `make test TORCH=torch`) -- the package itself only asks for torch>=2.4.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.normkit-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[lab,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m normkit lab

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build dist src/*.egg-info
