# slurmgpu developer entry points. `make demo` and `make test` are the two set-up commands.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
CLUSTER := bash contrib/local-slurm/cluster.sh

.PHONY: install demo test test-unit bench lint cluster-up cluster-down cluster-status clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[train,dev]'
	touch $@

demo: install
	$(VENV)/bin/slurmgpu demo

test: install cluster-up
	$(PY) -m pytest -q

test-unit: install
	$(PY) -m pytest -q -m 'not slurm'

bench: install cluster-up
	$(PY) benchmarks/bench_gsbatch.py

lint: install
	$(VENV)/bin/ruff check slurmgpu tests benchmarks

cluster-up:
	$(CLUSTER) up

cluster-down:
	$(CLUSTER) down

cluster-status:
	$(CLUSTER) status

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis demo-out
