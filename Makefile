# trainguard: the two commands a fresh clone needs.
#   make run   installs trainguard into .venv and runs the agent on its built-in default config
#   make test  installs what the tests need (Debian packages when missing, as root) and runs the suite
#   make wheelhouse  trainguard's wheel and its runtime dependencies in wheelhouse/, for nodes without an index

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
DEB_TEST_PACKAGES = fuse3 libfuse2 prometheus prometheus-alertmanager prometheus-node-exporter slurmctld slurmd slurmdbd slurm-client munge mariadb-server systemd systemd-container util-linux

.PHONY: run test bench install install-test deb-test lint clean wheelhouse

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# An editable install takes seconds and pip -q says nothing meanwhile: a line first. PYTHONWARNINGS: setuptools'
# editable build warns at every install about folders named like the package (a UserWarning, nothing to act on).
install: $(BIN)/python
	@echo "installing trainguard into $(VENV) (pip install -e .)"
	@PYTHONWARNINGS=ignore::UserWarning $(BIN)/pip install -q -e .

install-test: $(BIN)/python
	@echo "installing trainguard and what its tests need into $(VENV) (pip install -e '.[test]')"
	@PYTHONWARNINGS=ignore::UserWarning $(BIN)/pip install -q -e '.[test]'

run: install
	$(BIN)/trainguard run

deb-test:
	@missing=$$(for p in $(DEB_TEST_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "installing Debian packages:" $$missing; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
		else \
			echo "not root: tests needing these Debian packages will skip (or fail under CI=true):" $$missing; \
		fi; \
	fi

test: deb-test install-test
	$(BIN)/ruff check trainguard tests benchmarks
	$(BIN)/python -m pytest

# Benchmarks print markdown tables for docs/benchmarks.md; several need root (/dev/kmsg, tmpfs, the SLURM cluster).
bench: deb-test install-test
	$(BIN)/python -m benchmarks.footprint --minutes 10
	$(BIN)/python -m benchmarks.xid_latency --trials 50 --slurm
	$(BIN)/python -m benchmarks.hang_and_leak --trials 20
	$(BIN)/python -m benchmarks.log_scan --size-mib 1024
	$(BIN)/python -m benchmarks.kmsg_parse --records 200000
	$(BIN)/python -m benchmarks.round_cost --rounds 10
	$(BIN)/python -m benchmarks.hardware --runs 300
	$(BIN)/python -m benchmarks.prolog_gate --runs 50
	$(BIN)/pip install -q -e '.[bench]'
	flock /tmp/trainguard-tests.lock $(BIN)/python -m benchmarks.goodput --minutes 15 --also-without 60,120,240

# Wheels for this machine's Python and architecture: build it on a machine like the nodes (docs/install.md).
wheelhouse: $(BIN)/python
	rm -rf wheelhouse
	$(BIN)/pip wheel --quiet --disable-pip-version-check --wheel-dir wheelhouse .
	@ls wheelhouse

lint: install-test
	$(BIN)/ruff check trainguard tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache wheelhouse
