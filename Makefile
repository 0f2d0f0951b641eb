# Every target bootstraps .venv from the pinned requirements first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STORE ?= demo-store

.PHONY: venv demo cluster-demo format-demo test bench schemas clean fuzz soak

$(BIN)/.installed: requirements.txt requirements-dev.txt requirements-gym-test.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==25.3
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet -r requirements-gym-test.txt
	$(BIN)/python -m pip install --quiet --no-deps --ignore-requires-python nemo-gym==0.7.0
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/python -m devtools.demo --store "$(STORE)"

# A head and two worker Ray nodes on this machine (ray start), SeaweedFS, Gym hosts 127.0.0.2/.3:
# a whole-job crash and the loss of worker machine tq, each restarted and checked (devtools/cluster.py).
cluster-demo: venv
	$(BIN)/python -m devtools.cluster $(CLUSTER_ARGS)

format-demo: venv
	$(BIN)/python -m snapformat.demo --store "$(STORE)-format"

# Two workers, one per core: each test module whole in one worker (its module fixtures start once), and the
# modules that start Ray all in one worker (tests/worker_groups.py), so two Ray instances never share the cores.
TEST_WORKERS ?= 2

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

soak: venv
	OBJECTS_CRASH_WALK=400 OBJECTS_RACE_ROUNDS=100 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/snapformat/test_objects_crash.py tests/snapformat/test_objects_race.py
	$(BIN)/python -m devtools.soak --minutes $(or $(SOAK_MINUTES),10)
	CLUSTER_SOAK=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/coordinator/test_cluster.py

bench: venv
	BENCH_SMOKE=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/benchmarks
	$(BIN)/python -m benchmarks.run

schemas: venv
	$(BIN)/python -m schemas spec/jsonschema

clean:
	rm -rf $(VENV) demo-store .pytest_cache .hypothesis

fuzz: venv
	FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest -q tests/fuzz
