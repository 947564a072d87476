# haiku_state: `make train EXP=resnet` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The JAX plugin for the accelerator, installed beside jaxlib at jax's pinned version:
# none for CPU, cuda12 (or cuda13) for NVIDIA GPUs, tpu for Cloud TPUs. It follows
# JAX_PLATFORMS, so `JAX_PLATFORMS=cuda make bench` installs what it runs on; set
# ACCELERATOR to choose another.
ACCELERATOR ?= $(if $(findstring cuda,$(JAX_PLATFORMS)),cuda12,$(if $(findstring tpu,$(JAX_PLATFORMS)),tpu,cpu))
JAX_VERSION := $(shell sed -n 's/^jax==//p' constraints.txt)
JAX_PLUGIN := $(if $(filter cpu,$(ACCELERATOR)),,'jax[$(ACCELERATOR)]==$(JAX_VERSION)')
STAMP := $(VENV)/.installed-$(ACCELERATOR)
EXP ?= resnet
# EXP may name a variant of an experiment's config: EXP=resnet50:imagenet.
CONFIG := experiments/$(subst :,.py:,$(EXP))$(if $(findstring :,$(EXP)),,.py)
WORKDIR ?= runs/$(subst :,-,$(EXP))
DEVICES ?= 2
ARGS ?=
# train-multiprocess: local processes joined by jax.distributed, DEVICES simulated CPU devices each.
PROCESSES ?= 2
PORT ?= 12345
# prepare: convert FROM (imagefolder:DIR, cifar10:DIR or digits) to ArrayRecord shards in TO.
FROM ?=
TO ?=
# Test processes: each simulates 4 CPU devices.
TEST_WORKERS ?= 2

.PHONY: install test train train-multiprocess eval prepare bench bench-quick bench-plot lint format clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,bench]' $(JAX_PLUGIN)
	touch $(STAMP)

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

train: install
	$(PY) -m haiku_state.train --config=$(CONFIG) --workdir=$(WORKDIR) \
		--cpu_devices=$(DEVICES) $(ARGS)

train-multiprocess: install
	@status=0; pids=""; \
	for k in $$(seq 0 $$(($(PROCESSES) - 1))); do \
		$(PY) -m haiku_state.train --config=$(CONFIG) --workdir=$(WORKDIR) \
			--cpu_devices=$(DEVICES) --coordinator_address=127.0.0.1:$(PORT) \
			--num_processes=$(PROCESSES) --process_id=$$k $(ARGS) & pids="$$pids $$!"; \
	done; \
	for pid in $$pids; do wait $$pid || status=1; done; exit $$status

eval: install
	$(PY) -m haiku_state.train --config=$(CONFIG) --workdir=$(WORKDIR) \
		--cpu_devices=$(DEVICES) --mode=eval $(ARGS)

prepare: install
	$(PY) -m haiku_state.prepare --from="$(FROM)" --to="$(TO)" $(ARGS)

bench: install
	$(PY) -m benchmarks.run $(ARGS)

bench-quick: install
	$(PY) -m benchmarks.run --quick $(ARGS)

bench-plot: install
	$(PY) -m benchmarks.plot $(ARGS)

lint: install
	$(VENV)/bin/ruff check haiku_state experiments tests benchmarks
	$(VENV)/bin/ruff format --check haiku_state experiments tests benchmarks

format: install
	$(VENV)/bin/ruff format haiku_state experiments tests benchmarks
	$(VENV)/bin/ruff check --fix haiku_state experiments tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
