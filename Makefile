# margo-gitops: the two commands a newcomer needs are `make demo` and `make test`.
# Everything they need is installed from here (virtual environment, Debian packages).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all venv test fuzz matrix soak lint schemas demo bench cluster kube otel clean

all: test

venv: $(STAMP)

# The venv is rebuilt when the project's dependencies change.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	@$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q python3-venv)
	@command -v git >/dev/null || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q git)
	@# A real OCI registry (CNCF distribution) for charts and Compose packages: tests and demo.
	@command -v docker-registry >/dev/null || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q docker-registry)
	@# A real Docker engine (dockerd runs as root here) and busybox for the test images the
	@# Compose driver's tests build locally (no image can be pulled from the internet).
	@[ -x /usr/sbin/dockerd ] || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q docker.io)
	@dpkg -s busybox-static >/dev/null 2>&1 || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q busybox-static)
	@# Real Kubernetes nodes (tools/kube/realnode.py): containerd, its shim and runc (with
	@# docker.io above) and the CNI plugins bridge, host-local, loopback and portmap.
	@[ -x /usr/bin/containerd ] && [ -x /usr/sbin/runc ] || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q containerd runc)
	@[ -x /usr/lib/cni/bridge ] || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q containernetworking-plugins)
	@# PostgreSQL for the fleet server's shared store: the tests start private clusters.
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q postgresql)
	@# Headless Chromium for the dashboard's browser tests (Playwright drives this one).
	@[ -x /usr/bin/chromium ] || ($(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

# The guards of the structure (issue 30): ruff (with complexity and statement limits), the
# package layers and no import cycles (import-linter), the line budgets of modules and functions
# (tools/budgets.py) and the strict type check (mypy); each allowlists only today's offenders.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m tools.budgets
	$(BIN)/mypy
	$(BIN)/python -m margo.schemas --check

# One pytest worker per core and one more (TEST_WORKERS=0 runs in this process): many tests
# wait on real processes (servers starting, nodes, containers), and with one worker a core
# the cores sat half idle (docs/benchmarks.md, "The test suite"). The tests of the control
# plane and of the Docker engine stay on one worker each (tests/conftest.py).
TEST_WORKERS ?= $(shell expr $$(nproc) + 1)

test: lint kube otel
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

# The costly property tests (a real server; sequences of real compiles), at their deep example
# counts (tests/kits/fuzzing.py); `make test` runs them at quick counts.
fuzz: venv
	MARGO_FUZZ=deep $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -p no:cacheprovider \
		tests/wfm/test_githttp_isolation.py tests/wfm/test_request_body_properties.py \
		tests/compiler/test_accounting_sequences.py

# Every cell of the device matrix (tests/matrix, docs/matrix.md): {rc.3, rc.2, Oct-2024 with
# Git} x {render, Helm on the control plane, Compose on the Docker engine} x {SQLite, two
# replicas on PostgreSQL}, for every feature (lifecycle, freshness, capacity-only changes,
# accounting, re-eligibility, the GPU application), and the staged rollouts on every mixed
# fleet (one device of each row on one driver and store); `make test` runs the quick subset
# (each feature module's QUICK, else kits/matrixkit.py's QUICK and QUICK_MIXES). The GPU
# feature held over wall time: `make soak`.
matrix: venv kube
	MARGO_MATRIX=full $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup \
		-p no:cacheprovider --durations=0 tests/matrix

# The GPU feature of the device matrix held for SOAK_MINUTES (tests/matrix/
# test_matrix_gpu_soak.py, docs/matrix.md) in each cell of SOAK_CELLS, the other node's CPU
# changing every SOAK_EVERY seconds: prints what it counted, then asserts it (the deployment
# never moved, Helm's revision still 1). Neither `make test` nor `make matrix` runs it.
SOAK_MINUTES ?= 10
SOAK_EVERY ?= 20
SOAK_CELLS ?= rc3-helm-sqlite
soak: venv kube
	MARGO_SOAK_MINUTES=$(SOAK_MINUTES) MARGO_SOAK_EVERY=$(SOAK_EVERY) \
		MARGO_SOAK_CELLS=$(SOAK_CELLS) $(BIN)/python -m pytest -q -s -p no:cacheprovider \
		--durations=0 tests/matrix/test_matrix_gpu_soak.py

schemas: venv
	$(BIN)/python -m margo.schemas

# The Kubernetes control plane and the real nodes' kubelet and kube-proxy, built from the
# pinned Go modules in tools/kube (cached under
# ~/.cache/margo-gitops/kube, or $$MARGO_KUBE_CACHE), for the tests and for people.
kube: venv
	@$(BIN)/python -m tools.kube.kubebuild >/dev/null

# The OpenTelemetry Collector (OTLP receiver, file exporter) built from the pinned Go modules in
# tools/otel (cached under ~/.cache/margo-gitops/otel, or $$MARGO_OTEL_CACHE): the tests'
# collector, and one for people (docs/observability.md).
otel: venv
	@$(BIN)/python -m tools.otel.otelbuild >/dev/null

# A real control plane on loopback with simulated nodes (and REAL_NODES=N real ones, which
# run containers: docs/kubernetes.md); prints its kubeconfigs.
REAL_NODES ?= 0
cluster: kube
	$(BIN)/python -m tools.kube.cluster --real-nodes $(REAL_NODES)

demo: venv
	@PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/demo.sh

bench: venv
	$(BIN)/python -m bench.validate
	$(BIN)/python -m bench.compile --server
	$(BIN)/python -m bench.first_manifest --devices 10000
	$(BIN)/python -m bench.first_manifest --devices 10000 --store replicas
	if [ -n "$(BENCH_LARGE)" ]; then $(BIN)/python -m bench.compile --devices 100000 --server \
		&& $(BIN)/python -m bench.first_manifest --devices 100000; fi
	$(BIN)/python -m bench.serve
	$(BIN)/python -m bench.bodies
	$(BIN)/python -m bench.reconcile
	$(BIN)/python -m bench.kube
	$(BIN)/python -m bench.kube_nodes
	$(BIN)/python -m bench.device_memory
	$(BIN)/python -m bench.fleet
	$(BIN)/python -m bench.fleet --polling waiting --quiet 120 --restart
	$(BIN)/python -m bench.held_polls --connections 10000
	$(BIN)/python -m bench.request_costs

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
