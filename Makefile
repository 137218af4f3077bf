# Two commands: `make run` trains the default job, `make test` runs the tests.
# Both create .venv and install the project first (torch pinned first: a CPU wheel unless you
# override TORCH, e.g. `make run TORCH=torch==2.13.0+cu128 ...` on a GPU machine).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(subst =,_,$(TORCH))
QUIET_PIP := { grep -v "is ignored: it is neither a file nor a directory" || true; }
CONFIG ?= training/configs/digits.yaml
ARGS ?=

.PHONY: setup run lint test test-unit bench clean

# The venv's own pip installs all of it (no self-upgrade: a download and ~12 s), without compiling,
# and then compileall byte-compiles the venv in parallel (~1.5 min on 2 cores). Compiled once here,
# not left to first imports: with PYTHONDONTWRITEBYTECODE set (it is on some machines) Python never
# writes what it compiles, and every Ray worker then compiles torch and Ray again (import torch:
# 7.7 s instead of 2.6). compileall's exit code is ignored: some packages ship test files in newer
# syntax (torch's py312_intrinsics.py), which nothing imports. Left out: the packages' own test
# folders and pip and setuptools, which nothing here imports (a fifth of the files).
#
# The tests run a real Spark (local mode), which needs a Java runtime: installed from the OS packages
# where it is missing and this is a root shell with apt-get; elsewhere the Spark test says what to do.
# So is a one-node Slurm (munge and Slurm's daemons, without recommends: ~30 s) for the Slurm test,
# and Azurite, the Azure Storage emulator (npm, ~38 s, into the venv: `make clean` removes it), for
# the Azure Blob tests where Node is present; it installs while pip does. Elsewhere those tests skip
# saying what to install.
$(STAMP): pyproject.toml
	@command -v java > /dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null \
		&& { apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless > /dev/null; } \
		|| echo "note: no Java runtime; install one (Java 17+) for the Spark test"; }; \
	[ -x /usr/sbin/slurmd ] || command -v slurmd > /dev/null \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null \
		&& for try in 1 2; do DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			munge slurmctld slurmd slurm-client > /dev/null && break; apt-get update -qq; false; done; } \
		|| echo "note: no Slurm; install munge and Slurm (slurmctld, slurmd, slurm-client) for the Slurm test"; \
	command -v npm > /dev/null || echo "note: no Node.js; install Node 18+ for the Azure Blob tests (Azurite)"
	$(PYTHON) -m venv $(VENV)
	@if command -v npm > /dev/null && [ ! -x $(VENV)/azurite/node_modules/.bin/azurite-blob ]; then \
		npm install --prefix $(VENV)/azurite --no-audit --no-fund --loglevel=error azurite@3.35.0 \
			> /dev/null 2>&1 & fi; \
	echo '$(PY) -m pip install ... (and compileall; Azurite meanwhile)'; \
	$(PY) -m pip install -q --no-compile "$(TORCH)" 2>&1 | $(QUIET_PIP) \
		&& $(PY) -m pip install -q --no-compile -e ".[test]" 2>&1 | $(QUIET_PIP) \
		&& { $(PY) -m compileall -q -j 0 -x '/(tests?|pip|setuptools)/' \
			"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null 2>&1 || true; }; \
	status=$$?; wait; exit $$status
	$(PY) -c "import torch, ray, mlflow, pyarrow; print('installed: torch', torch.__version__, 'ray', ray.__version__, 'mlflow', mlflow.__version__)"
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PY) -m training $(CONFIG) $(ARGS)

# ruff (pyflakes, import order, line length; settings in pyproject.toml): `make test` starts with it.
lint: setup
	$(PY) -m ruff check .

# Two workers: first they share the tests without Ray, then each takes one group of Ray tests and
# runs it in order, one test at a time: those that start their own Ray, and the quick bench with the
# tests on the shared cluster (tests/conftest.py groups them). Never more than two Ray tests at once.
# (--no-loadscope-reorder: in the order collected, not the largest groups first, which would start
# both Ray groups at once and leave the tests without Ray until one of them ends.)
test: lint
	$(PY) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder $(ARGS)

bench: setup
	$(PY) -m bench $(ARGS)

test-unit: setup
	$(PY) -m pytest -m "not ray" $(ARGS)

clean:
	rm -rf $(VENV) runs mlflow.db mlruns .pytest_cache
