# hlb's two commands: `make demo` runs the product, `make test` passes the tests.
# Both set everything up on a fresh machine (Python 3.11+; Java 17 and Maven for Kafka).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hlb-installed
EXPORT_STAMP := $(VENV)/.hlb-export-installed
DURATION ?= 0
PYTEST_ARGS ?=

.PHONY: help install install-export kafka tools lint test demo model proto clean

help:
	@echo "make demo [DURATION=60]  start Kafka, the daemon and a simulated agent; show placements"
	@echo "make test                 set up (tools too), start Kafka, run ruff, mypy, lint-imports and the whole test suite"
	@echo "make model                train the GNN (hlb train) and export it to daemon/data/model (the shipped one)"
	@echo "make proto                regenerate the checked-in code from proto/hlb/v1/*.proto"
	@echo "make clean                remove the virtualenv, caches and demo files"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(STAMP)

# The export extra (torch, onnx) for export/ and its tests; the daemon never needs it. On Linux
# torch's wheel pulls its CUDA libraries too (about 5 GB installed, 1-2 minutes from a cold cache):
# torch cannot be imported without them, even on a CPU-only machine.
$(EXPORT_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,export]"
	touch $@

install-export: $(EXPORT_STAMP)

# Apache Kafka's jars from Maven Central into .cache/kafka (skipped where Java is missing).
kafka: install
	@if command -v java >/dev/null 2>&1; then $(PY) -m hlb.sim.kafka_local fetch; \
	else echo "java not found: the Kafka broker cannot run here"; fi

# Clients some tests drive, built with Go into .cache/tools/bin: grpcurl and ghz (reflection);
# the generators of docs/clients.md's Go example; and the Go modules of tests/extender
# (kube-scheduler's extender types). With npm, the Node example's packages into .cache/tools/node.
# promtool (the alert rules' tests) comes from Debian's prometheus package (.ci/run installs it).
# Where Go is missing nothing is built, and the tests that need a tool skip saying which.
TOOLS_BIN := $(CURDIR)/.cache/tools/bin
GO_TOOLS := github.com/fullstorydev/grpcurl/cmd/grpcurl@v1.9.3 github.com/bojand/ghz/cmd/ghz@v0.121.0 \
	google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.5 google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
NODE_TOOLS := $(CURDIR)/.cache/tools/node
tools:
	@if command -v go >/dev/null 2>&1; then \
		for tool in $(GO_TOOLS); do \
			name=$${tool%%@*}; name=$${name##*/}; \
			[ -x "$(TOOLS_BIN)/$$name" ] || { echo "building $$name"; GOBIN="$(TOOLS_BIN)" go install "$$tool" \
				|| echo "could not build $$name: the tests that drive it skip"; }; \
		done; \
		(cd tests/extender && go mod download); \
	else echo "go not found: grpcurl and ghz are not built (the tests that drive them skip)"; fi
	@if command -v npm >/dev/null 2>&1; then \
		[ -d "$(NODE_TOOLS)/node_modules/@grpc/proto-loader" ] || { mkdir -p "$(NODE_TOOLS)" && \
			npm install --prefix "$(NODE_TOOLS)" --no-audit --no-fund --silent @grpc/grpc-js@1 @grpc/proto-loader@0.8; }; \
	else echo "npm not found: the Node client example's test skips"; fi
	@command -v promtool >/dev/null 2>&1 || echo "promtool not found: the alert rules' tests skip (Debian: apt-get install prometheus)"
	@command -v prometheus-node-exporter >/dev/null 2>&1 || command -v node_exporter >/dev/null 2>&1 || \
		echo "node_exporter not found: the agent's live tests skip (Debian: apt-get install prometheus-node-exporter)"

lint: install-export
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

test: install-export kafka tools lint
	$(PY) -m hlb.sim.kafka_local exec -- $(PY) -m pytest $(PYTEST_ARGS)

demo: install kafka
	$(PY) -m hlb.cli demo --duration $(DURATION)

# The shipped GNN and its no-graph ablation: the default training recipe (192 logged simulations,
# 43 minutes on 2 cores when logged in one process, now in two (hlb train --workers); then about 17
# minutes of fitting per model), the second model on the first one's data, then hlb export into the
# package. CI never runs this; it trains a tiny model in the tests.
TRAIN_OUT ?= .cache/train
model: install-export
	rm -rf $(TRAIN_OUT)
	$(PY) -m hlb.cli train --out $(TRAIN_OUT)/default --no-progress
	$(PY) -m hlb.cli train --out $(TRAIN_OUT)/no-graph --no-graph --data $(TRAIN_OUT)/default/data.pt --no-progress
	$(PY) -m hlb.cli export --checkpoint $(TRAIN_OUT)/default/best.pt --out daemon/data/model
	$(PY) -m hlb.cli export --checkpoint $(TRAIN_OUT)/no-graph/best.pt --out daemon/data/model-no-graph

proto: install
	$(PY) proto/generate.py

clean:
	rm -rf $(VENV) .cache .demo .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .grimp_cache *.egg-info
