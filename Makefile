# kubeproxy: the two commands that matter are `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup run test lint typecheck unit clean

setup:
	@./scripts/setup.sh

# Program a network namespace from the bundled example cluster and show a real
# connection through a ClusterIP.
run: setup
	$(PY) -m kubeproxy.cmd.demo examples/cluster

lint: setup
	$(VENV)/bin/ruff check kubeproxy tests bench examples images
	$(VENV)/bin/ruff format --check kubeproxy tests bench examples images

typecheck: setup
	$(VENV)/bin/mypy

test: setup lint typecheck
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# The DaemonSet's image (images/README.md): images/Dockerfile built with docker or podman,
# whichever is here, on the registry's debian:bookworm-slim or, when no registry is
# reachable, a base made from Debian's packages; prints what a node pulls and unpacks and
# what each part costs. IMAGE names it; IMAGE_ARGS="--refresh" resolves the Python
# dependencies again now (else once a day).
IMAGE ?= localhost/kubeproxy:dev
.PHONY: image test-image
image: setup
	$(PY) -m images.build --tag $(IMAGE) $(IMAGE_ARGS)

# The image built from this checkout and run as images/manifests/daemonset.yaml says, and
# the measurement of what its slimming may leave out (also part of make test).
test-image: setup
	$(VENV)/bin/pytest -q tests/test_image_run.py tests/test_image_tools.py $(PYTEST_ARGS)

# Every kernel test and flow case on Debian's kernels (tests/vm/kernels.txt), each booted
# in QEMU under emulation with virtme-ng; setup-kernels installs QEMU and fetches the
# kernels from Debian's packages into .cache/kernels. Not part of `make test`
# (docs/kernels-and-images.md: "Kernels tested" says what it costs). KERNELS_ARGS: `--only debian12-6.1`, or pytest
# arguments after `--`.
.PHONY: setup-kernels test-kernels test-kernels-ci
setup-kernels:
	@./scripts/setup-kernels.sh

test-kernels: setup-kernels
	$(PY) -m tests.vm.host $(KERNELS_ARGS)

# What .ci/run boots after `make test`: Debian 12's two kernel series (6.1, and 6.12, the
# one Debian 13 runs too), each with the ci scope (the support check, a real start of the
# binary, every nftables flow case in both families); about 15 min a kernel.
CI_KERNELS := debian12-6.1 debian12-6.12
test-kernels-ci:
	KPX_KERNELS="$(CI_KERNELS)" ./scripts/setup-kernels.sh
	$(PY) -m tests.vm.host --scope ci $(foreach k,$(CI_KERNELS),--only $(k))

# Every kernel test and flow case in other Debian userspaces (Debian 13, unstable), on this
# machine's kernel at native speed, side by side with this machine's own (host): each
# root filesystem built with mmdebstrap into .cache/userspace/<suite>/ (kept until its
# inputs change) with its own venv, run in mount and PID namespaces of its own. Not part
# of `make test` (docs/kernels-and-images.md: "Userspaces tested" says what it costs). One userspace:
# `make test-userspace USERSPACES=trixie`; pytest arguments: USERSPACE_ARGS='-- -k x'.
USERSPACES ?= host trixie sid
.PHONY: setup-userspace test-userspace
setup-userspace:
	@./scripts/setup-userspace.sh $(filter-out host,$(USERSPACES))

test-userspace: setup-userspace
	$(PY) -m tests.userspace.run $(USERSPACES) $(USERSPACE_ARGS)

# Benchmarks: our nftables and iptables backends and upstream's nftables rule structure,
# side by side (bench/README.md). bench-quick: a few minutes; bench: everything (long).
# Results: bench/results/latest.md, PNG plots and one JSON file per run; then
# `python -m bench.readme` puts the figures into README.md and docs/benchmarks.md. Never part of `make test`.
# bench-micro: the core and the renderers in memory (bench/test_micro.py, about a
# minute), compared with the committed baseline; fails when a minimum is 20 % slower.
.PHONY: bench bench-quick bench-micro bench-micro-baseline
MICRO_BASELINE := bench/results/micro-baseline.json
MICRO := $(VENV)/bin/pytest bench/test_micro.py --benchmark-sort=name

bench-micro: setup
	$(MICRO) --benchmark-compare=$(MICRO_BASELINE) --benchmark-compare-fail=min:20% \
		$(BENCH_ARGS)

bench-micro-baseline: setup
	$(MICRO) --benchmark-json=$(MICRO_BASELINE) $(BENCH_ARGS)

bench-quick: setup
	KPXB_COMMAND="make bench-quick" KPXB_INCREMENTAL_BUDGET_S=5 \
		$(VENV)/bin/pytest bench -m quick --benchmark-sort=name $(BENCH_ARGS)

bench: setup
	KPXB_COMMAND="make bench" $(VENV)/bin/pytest bench \
		--benchmark-sort=name $(BENCH_ARGS)

# Repair times after someone else removes our rules, 10k Services by default
# (bench/selfheal.py; docs/operators.md: "Surviving firewall reloads"). Not part of bench.
.PHONY: bench-selfheal
bench-selfheal: setup
	$(PY) -m bench.selfheal $(SELFHEAL_ARGS)

# Taking a node over from upstream's kube-proxy (and between our modes) at scale:
# bench/takeover.py, images/README.md: "Replacing kube-proxy". Not part of bench.
.PHONY: bench-takeover
bench-takeover: setup
	$(PY) -m bench.takeover $(TAKEOVER_ARGS)

# The soak (issue 31): the daemon a node runs, over the bench's realistic mix in the fake
# API server, under churn and a fault per round (kill -9 mid sync, SIGTERM, nft flush
# ruleset, table deletes, API restarts and 410s, address changes, hung backends, a full
# conntrack table), checked at every round against a fresh sync and with real
# connections (bench/soak.py; 45-90 minutes; bench/results/soak.md). `make test` runs
# its short version (tests/test_soak.py, about two minutes).
.PHONY: soak
soak: setup
	$(PY) -m bench.soak $(SOAK_ARGS)

# Connections to Services while others flush, delete and reload, with the owned table and
# with today's unowned one side by side, 10k Services by default (bench/owned.py;
# docs/operators.md: "Surviving firewall reloads"). Not part of bench.
.PHONY: bench-owned
bench-owned: setup
	$(PY) -m bench.owned $(OWNED_ARGS)

# The kernel floor of a full sync (issue 32): the batches our full sync sends, replayed by
# the same writer into an empty namespace, next to our full sync and its profile, at 10k,
# 30k and 100k Services, uniform and realistic (bench/floor.py; about 25 minutes here). Not
# part of bench. FLOOR_ARGS="--sizes 1000,10000 --mixes uniform".
.PHONY: bench-floor
bench-floor: setup
	KPXB_COMMAND="make bench-floor $(FLOOR_ARGS)" $(PY) -m bench.floor $(FLOOR_ARGS)

# Where the whole process's memory is at its peak (issue 32): kube-proxy-nftables --once
# over JSON manifests under /usr/bin/time -v, then twice under tracemalloc, the live
# allocations summed by file and line at the traced peak (bench/memory.py; 100k Services
# by default, about 20 minutes here). MEMORY_ARGS="--services 10000".
.PHONY: bench-memory
bench-memory: setup
	KPXB_COMMAND="make bench-memory $(MEMORY_ARGS)" $(PY) -m bench.memory $(MEMORY_ARGS)
