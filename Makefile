# slurmgpu developer entry points. `make demo` and `make test` are the two set-up commands.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
CLUSTER := bash contrib/local-slurm/cluster.sh
DBS     := bash contrib/local-db/databases.sh

.PHONY: install pyslurm test-deps site-install demo test test-unit test-slurm-diff bench bench-backends bench-decision bench-memory evaluate evaluate-load replay lint cluster-up cluster-down cluster-status db-up db-down clean

install: $(VENV)/.installed
	-@sh contrib/pyslurm/install.sh $(PY)

# pyslurm matched to the running Slurm (else one line, and the CLI backend): contrib/pyslurm/install.sh.
pyslurm: $(VENV)/.installed
	-@sh contrib/pyslurm/install.sh $(PY)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[train,dev]'
	touch $@

# Debian packages the tests need beyond Slurm and the databases (python3-venv, Chromium).
test-deps:
	bash contrib/lib/test-deps.sh

# For every user of a site, as root: a venv of the system Python under PREFIX with a wheel of this
# checkout and pyslurm matched to the running Slurm (PYSLURM=no skips it), commands linked into
# /usr/local/bin, /etc/slurmgpu, the nightly account and spools (docs/admins/install.md;
# contrib/site/install.sh lists its other variables).
PREFIX ?= /opt/slurmgpu
site-install:
	PREFIX=$(PREFIX) bash contrib/site/install.sh

demo: install
	$(VENV)/bin/slurmgpu demo

# The whole suite: the real local Slurm, PostgreSQL and MariaDB are started first.
test: test-deps install cluster-up db-up
	eval "$$($(DBS) env)" && $(PY) -m pytest -q

# A few hundred generated GPU requests, each checked against the live Slurm (tests/test_slurm_diff.py).
test-slurm-diff: install cluster-up
	SLURMGPU_DIFF_EXAMPLES=300 $(PY) -m pytest -q -p no:cacheprovider tests/test_slurm_diff.py

test-unit: install
	$(PY) -m pytest -q -m 'not slurm'

bench: install cluster-up
	$(PY) benchmarks/bench_gsbatch.py
	$(PY) benchmarks/bench_ingest.py
	$(PY) benchmarks/bench_serve.py
	$(PY) benchmarks/bench_model.py
	$(PY) benchmarks/bench_workload.py
	$(PY) benchmarks/bench_large_scripts.py

# The Slurm queries (ledger refresh, accounting, ingest) through the command-line tools and through pyslurm.
bench-backends: install cluster-up
	$(PY) benchmarks/bench_backends.py

# The decider's GPU-type choice on histories built from published throughputs with hidden work,
# habitual types and OOM rows, scored on the measurements (docs/benchmarks-decision.md).
DECISION_ARGS ?=
bench-decision: install
	$(PY) benchmarks/bench_decision.py $(DECISION_ARGS)

# The peak estimate and the bound shown on published peaks: unseen batches, unseen architectures,
# every GPU generation (docs/decision-model.md, "Grounded in published measurements").
MEMORY_ARGS ?=
bench-memory: install
	$(PY) benchmarks/bench_memory.py $(MEMORY_ARGS)

# Policies side by side on a generated ~50k-job workload, simulated (results and plots in scenario-report/).
evaluate: install
	$(VENV)/bin/slurmgpu scenario --report-dir scenario-report

# The policies at several loads (shares of GPUs allocated; the arrival rate is calibrated to each).
LOADS ?= 0.3,0.6,0.9
DAYS  ?= 7
SEED  ?= 4242
evaluate-load: install
	$(VENV)/bin/slurmgpu scenario --load $(LOADS) --days $(DAYS) --seed $(SEED) --report-dir scenario-report

# A small generated workload submitted through gsbatch to the local cluster, then checked against the simulator.
replay: install cluster-up
	$(PY) -m slurmgpu.simulation.replay

# Style, import layers (contracts in pyproject.toml) and types.
lint: install
	$(VENV)/bin/ruff check slurmgpu tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

cluster-up:
	$(CLUSTER) up

cluster-down:
	$(CLUSTER) down

cluster-status:
	$(CLUSTER) status

db-up:
	$(DBS) up

db-down:
	$(DBS) down

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis demo-out
