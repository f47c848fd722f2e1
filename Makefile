PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the OpenAPI linter (a pinned @redocly/cli, openapi/package.json), run by `make test` and `make lint-spec`
SPEC_LINTER := openapi/node_modules/.bin/redocly

.PHONY: install run docs test abuse stress lint lint-spec fmt openapi bench sim sim-cluster chaos clean

# `make run` installs the service alone (`.[server]`); `make test` and the other targets add the test toolchain
SERVER_STAMP := $(VENV)/.installed-server

$(SERVER_STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[server]'
	touch $(SERVER_STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP) $(SERVER_STAMP)

install: $(STAMP)

run: $(SERVER_STAMP)
	$(BIN)/switchboard serve

lint: $(STAMP)
	$(BIN)/ruff check service tests bench migrations
	$(BIN)/ruff format --check service tests bench migrations
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m tests.import_cycles switchboard
	@# every function at cyclomatic complexity C or better; `radon cc -s -n D service/switchboard` names the offenders
	$(BIN)/xenon --max-absolute C --max-modules B --max-average A service/switchboard

fmt: $(STAMP)
	$(BIN)/ruff format service tests bench migrations
	$(BIN)/ruff check --fix service tests bench migrations

# four workers, each test file on one of them (its fixtures, servers and databases stay its own): most e2e time is
# waiting on servers and clocks (SWITCHBOARD_TEST_CPU_REPORT=FILE, then `python -m tests.cpu_report FILE`: with three
# workers the suite's processes kept about one core of two busy). PYTEST_WORKERS=0: one process; the 25 slowest
# tests are listed at the end, to keep the suite inside its ten minutes
PYTEST_WORKERS ?= 4

test: lint $(SPEC_LINTER)
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=25

# the abuse suite alone (docs/security.md, "One budget per caller, at every door"): a test per door, slow and many
# clients, floods by one key's tokens, forged Redis messages; all of it runs in `make test` as well
ABUSE := tests/e2e/test_slow_clients.py tests/unit/test_connection_gate.py tests/e2e/test_stream_budgets.py \
	tests/e2e/test_media_budgets.py tests/api/test_read_budget.py tests/e2e/test_export_budget.py \
	tests/e2e/test_cluster_redis.py tests/store/test_fanout.py tests/store/test_shared_buckets.py \
	tests/api/test_security.py tests/api/test_hardening.py tests/api/test_limits.py tests/e2e/test_browser_origin.py

abuse: $(STAMP)
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(ABUSE)

# the suite (or TESTS, a pytest selection) RUNS times, with HOG busy-looping processes beside it, to see a flaky test
# before CI does (docs/reliability.md); KEEP_GOING=1 runs them all even after a failure
RUNS ?= 5
HOG ?= 2
TESTS ?=
KEEP_GOING ?=
stress: $(STAMP)
	$(BIN)/python -m tests.stress --runs $(RUNS) --hog $(HOG) --workers $(PYTEST_WORKERS) $(if $(KEEP_GOING),--keep-going) $(TESTS)

# the documentation site (mkdocs.yml: docs/ as pages); --strict makes a broken link or a page left out an error
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir var/site

openapi: $(STAMP)
	$(BIN)/switchboard openapi --output openapi/openapi.json
	$(BIN)/switchboard asyncapi --output openapi/asyncapi.json

# the OpenAPI document under Redocly's recommended rules (openapi/redocly.yaml), by the linter pinned in
# openapi/package-lock.json: any error or warning fails (tests/api/test_openapi_lint.py; without npm it skips,
# except under CI=true)
$(SPEC_LINTER): openapi/package.json openapi/package-lock.json
	if command -v npm >/dev/null; then cd openapi && npm ci --no-audit --no-fund && touch node_modules/.bin/redocly; \
	else echo "npm not found: the OpenAPI lint test cannot run" >&2; fi

lint-spec: $(STAMP) $(SPEC_LINTER)
	$(BIN)/pytest -q tests/api/test_openapi_lint.py

bench: $(STAMP)
	$(BIN)/python bench/runtime_interrupt.py
	$(BIN)/python bench/store_append.py

SEEDS ?= 10000
sim: $(STAMP)
	$(BIN)/python -m tests.sim.schedules --seeds $(SEEDS)

# the cluster simulation (docs/simulation.md, "Cluster"): 1,000 seeds unless SEEDS is given; BEFORE=<fix> switches
# one fix off (db_clock, write_time_epochs, receipts_with_effect, hand_over, resume_calls, fenced_reports,
# live_when_moving, leased_claims, transcript_ids, edge_connections)
sim-cluster: $(STAMP)
	$(BIN)/python -m tests.sim.cluster --seeds $(if $(filter file,$(origin SEEDS)),1000,$(SEEDS)) \
		$(if $(BEFORE),--before $(BEFORE))

# a long chaos run of cluster mode (docs/chaos.md): three nodes on a fresh PostgreSQL database and a Redis of its own,
# faults from the seed for about DURATION seconds, then the checker; exit status 1 when it finds a violation
SEED ?= 1
DURATION ?= 300
CHAOS_SESSIONS ?= 16
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos --seed $(SEED) --duration $(DURATION) --sessions $(CHAOS_SESSIONS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
