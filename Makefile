# One command each: `make demo` trains the digits demo, `make test` runs the suite.
# Both set up .venv first on a fresh machine: the demo with what it needs, the tests with the rest.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Two installs into the one venv. The demo's: ElasticDL and one TensorFlow (tensorflow-cpu), 1.6 GB
# (was 3.2 GB with two TensorFlows). The tests' on top of it (2.8 GB): the developer tools and every extra the suite exercises.
DEMO_STAMP := $(VENV)/.demo-stamp
STAMP := $(VENV)/.installed-stamp
TEST_EXTRAS := cpu,dev,kafka,kubernetes,parquet,pandas
# tf-keras at the installed tensorflow-cpu's minor version (tf-keras 2.21.x goes with TensorFlow 2.21).
TF_KERAS = "tf-keras~=$$($(PY) -c 'import importlib.metadata as m; print(".".join(m.version("tensorflow-cpu").split(".")[:2]))').0"

.PHONY: install keras2 demo test lint proto bench bench-smoke clean simulate chaos kills replicas-acceptance

$(DEMO_STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[cpu]"
	@# A venv made before tf-keras was installed without its dependencies holds `tensorflow` too,
	@# whose files overwrote tensorflow-cpu's (one package directory): remove it, restore tensorflow-cpu.
	if $(PY) -m pip show --quiet tensorflow >/dev/null 2>&1; then \
	    $(PY) -m pip uninstall --quiet -y tensorflow && \
	    $(PY) -m pip install --quiet --no-deps --force-reinstall \
	        "tensorflow-cpu==$$($(PY) -c 'import importlib.metadata as m; print(m.version("tensorflow-cpu"))')"; \
	fi
	touch $@

# tf-keras requires the `tensorflow` distribution, which pip would install beside tensorflow-cpu
# (2 TensorFlows, 3 GB, whichever wrote its files last imported): install it without dependencies.
keras2: $(DEMO_STAMP)
	$(PY) -m pip install --quiet --no-deps $(TF_KERAS)

# s3fs first, alone: its aiobotocore allows a few botocore releases, and boto3 (moto's) is then
# pinned to the botocore installed. In one step pip tried boto3 and botocore releases one by one
# backwards from the newest (200 botocore downloads of 15 MB in 5 minutes, not done).
$(STAMP): $(DEMO_STAMP)
	$(PY) -m pip install --quiet -e ".[s3]"
	$(PY) -m pip install --quiet -e ".[$(TEST_EXTRAS)]" \
	    "boto3==$$($(PY) -c 'import importlib.metadata as m; print(m.version("botocore"))')"
	$(PY) -m pip install --quiet --no-deps $(TF_KERAS)
	touch $@

install: $(STAMP)

data/digits/train: | $(DEMO_STAMP)
	$(PY) model_zoo/digits/prepare_data.py --output data/digits

demo: $(DEMO_STAMP) data/digits/train
	rm -rf out/digits-checkpoints  # a demo starts fresh; real jobs continue with --checkpoint_dir_for_init
	$(VENV)/bin/elasticdl train \
	    --model_zoo model_zoo --model_def digits.digits_functional.custom_model \
	    --training_data data/digits/train --validation_data data/digits/test \
	    --num_workers 2 --num_ps 1 --minibatch_size 32 --num_epochs 5 \
	    --checkpoint_dir out/digits-checkpoints --output out/digits-model \
	    --job_name digits-demo

# Two test processes (pytest-xdist), one file at a time each: the end-to-end jobs wait on their
# processes about half the time, so two files side by side fill the 2 cores CI has.
test: $(STAMP)
	$(VENV)/bin/lint-imports  # the one-way dependencies of pyproject.toml
	$(VENV)/bin/bandit -q -r elasticdl elasticdl_preprocessing benchmarks model_zoo -x elasticdl/proto -ll  # security lint: a medium or high finding fails (a justified one: `# nosec` under its reason)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 -m 'not bench' tests

# The benchmark suite end to end at tiny sizes (about 2 minutes): outside `make test`'s 15-minute
# budget, as `make bench` is.
bench-smoke: $(STAMP)
	$(PY) -m pytest -q -m bench tests/test_benchmarks_smoke.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Regenerate the gRPC code after editing protos/elasticdl.proto.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=elasticdl/proto --grpc_python_out=elasticdl/proto protos/elasticdl.proto
	sed -i 's/^import elasticdl_pb2 as/from elasticdl.proto import elasticdl_pb2 as/' elasticdl/proto/elasticdl_pb2_grpc.py

clean:
	rm -rf $(VENV) data out runs

# The benchmark suite (docs/benchmarks.md), about half an hour on 2 cores; results in runs/benchmarks.
# make bench QUICK=1 (tiny sizes, the smoke test), CASES=training,ps_data_plane, REPS=5
bench: $(STAMP)
	$(PY) -m benchmarks $(if $(QUICK),--quick) $(if $(CASES),--cases $(CASES)) $(if $(REPS),--reps $(REPS)) \
	    $(if $(MODELS),--models $(MODELS)) $(if $(COMPETITORS),--competitors $(COMPETITORS))

# Issue 26's acceptance runs of --ps_replicas in full (docs/replicas.md): sync and async, digits,
# 20 epochs, ps-1 SIGKILLed at epoch 6, each against its fault-free job; minutes, not in make test.
replicas-acceptance: $(STAMP)
	$(PY) -m benchmarks.replicas_acceptance

# The deterministic simulator (docs/reliability.md, "Simulation"): SEEDS seeds of the whole job
# under random faults; prints a replay command per failing seed and "N seeds, F faults, V invariant violations".
simulate: $(STAMP)
	$(PY) -m elasticdl.sim --seeds $(or $(SEEDS),1000) --jobs 2

# The random nemesis on real processes (docs/reliability.md#chaos): SEEDS jobs, one at a time, each
# under its seeded faults, checked from outside. A violation prints its replay command.
# make chaos SEEDS=100 FIRST=200 MODE=async CHAOS_DIR=/tmp/chaos; make chaos SEED=12 (one seed again)
chaos: $(STAMP)
	$(PY) -m tests.chaos.nemesis $(if $(SEED),--seed $(SEED),--seeds $(or $(SEEDS),20)) $(if $(FIRST),--first $(FIRST)) \
	    $(if $(MODE),--mode $(MODE)) $(if $(CHAOS_DIR),--workdir $(CHAOS_DIR))

# PS SIGKILLs at a random short delay after a checkpoint cut (docs/reliability.md, "Kills after a
# cut"): make kills SEEDS=20 MODE=both KILLS_DIR=/tmp/kills
kills: $(STAMP)
	$(PY) -m tests.chaos.kills_after_a_cut --seeds $(or $(SEEDS),10) --mode $(or $(MODE),one) \
	    $(if $(FIRST),--first $(FIRST)) $(if $(KILLS_DIR),--dir $(KILLS_DIR))
