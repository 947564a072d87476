# haiku_state: `make train EXP=resnet` and `make test` are all a fresh machine needs;
# `make` alone (`make help`) lists the targets and the variables.
#
# A stack is a Python version with a lock file, requirements/py<X.Y>.txt, that pins
# everything `make` installs (jax and jaxlib included). PYTHON is the newest stack's
# Python that runs here: pythonX.Y on PATH, else pyenv's X.Y.* versions (an inactive
# pyenv shim exits 127, so each candidate is run). `make test PYTHON=python3.11` picks
# another stack. The virtualenv is .venv for the newest stack and .venv-X.Y for the
# others, so they coexist. VENV= uses $(PYTHON) (default python3, the environment's) as
# it is, installs nothing and runs this checkout (PYTHONPATH): for an environment that
# already has JAX and its plugin.
comma := ,
# `make` alone and `make help` only print: they run without a Python of any stack.
HELP_ONLY := $(if $(filter-out help,$(or $(MAKECMDGOALS),help)),,yes)
STACKS := $(shell ls requirements/py*.txt 2>/dev/null | sed 's|^requirements/py||; s|\.txt$$||' | sort -rV)
# The first interpreter that runs, for the stacks $(1) in order: pythonX.Y, then pyenv's
# versions/X.Y.*/bin/pythonX.Y, newest first.
find_python = pyenv_root=$$(pyenv root 2>/dev/null || echo "$${PYENV_ROOT:-$$HOME/.pyenv}"); \
	for v in $(1); do \
	for p in python$$v $$(ls -d "$$pyenv_root"/versions/$$v.*/bin/python$$v 2>/dev/null | sort -rV); do \
		"$$p" -c '' 2>/dev/null && { echo "$$p"; exit 0; }; \
	done; done; exit 1
ifndef PYTHON
ifneq ($(origin VENV),undefined)
ifeq ($(VENV),)
# VENV= alone: the Python of the environment one is in.
PYTHON := python3
else
# A VENV that is named follows its Python (or its name's -X.Y), unless PYTHON is set.
VENV_STACK := $(or $(shell $(VENV)/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null),$(filter $(STACKS),$(lastword $(subst -, ,$(VENV)))))
endif
endif
endif
ifndef PYTHON
PYTHON := $(shell $(call find_python,$(or $(VENV_STACK),$(STACKS))))
endif
ifeq ($(PYTHON)$(HELP_ONLY),)
$(error No Python of the stacks $(STACKS) runs here (PATH, pyenv); set PYTHON=)
endif
STACK := $(if $(PYTHON),$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'))
ifeq ($(STACK)$(HELP_ONLY),)
$(error PYTHON=$(PYTHON) does not run)
endif
LOCK := requirements/py$(STACK).txt
VENV ?= $(if $(filter $(firstword $(STACKS)),$(STACK)),.venv,.venv-$(STACK))
ifeq ($(VENV),)
PY := $(PYTHON)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
else
PY := $(VENV)/bin/python
endif
# The JAX plugin for the accelerator, installed beside jaxlib at the lock's jax version:
# none for CPU, cuda12 (or cuda13) for NVIDIA GPUs, tpu for Cloud TPUs. It follows
# JAX_PLATFORMS, so `JAX_PLATFORMS=cuda make bench` installs what it runs on; set
# ACCELERATOR to choose another.
ACCELERATOR ?= $(if $(findstring cuda,$(JAX_PLATFORMS)),cuda12,$(if $(findstring tpu,$(JAX_PLATFORMS)),tpu,cpu))
JAX_VERSION = $(shell sed -n 's/^jax==//p' $(LOCK))
JAX_PLUGIN = $(if $(filter cpu,$(ACCELERATOR)),,'jax[$(ACCELERATOR)]==$(JAX_VERSION)')
# The stamp of an install of the package with the extras $(1) (joined by +): one per
# stack, accelerator and set of extras, redone when setup.cfg, pyproject.toml or the
# lock changes. None with VENV=: nothing is installed.
STAMP_PREFIX := $(VENV)/.installed-py$(STACK)-$(ACCELERATOR)-
installed = $(if $(VENV),$(STAMP_PREFIX)$(1))
EXP ?= resnet
EXPERIMENTS := $(notdir $(basename $(filter-out experiments/_%,$(wildcard experiments/*.py))))
# EXP may name a variant of an experiment's config: EXP=resnet50:imagenet.
CONFIG := experiments/$(subst :,.py:,$(EXP))$(if $(findstring :,$(EXP)),,.py)
WORKDIR ?= runs/$(subst :,-,$(EXP))
DEVICES ?= 2
ARGS ?=
# bench: the curated record to write (see the bench target); none by default.
RECORD ?=
# train-multiprocess: local processes joined by jax.distributed, DEVICES simulated CPU devices each.
PROCESSES ?= 2
PORT ?= 12345
# prepare: convert FROM (imagefolder:DIR, cifar10:DIR or digits) to ArrayRecord shards in TO.
FROM ?=
TO ?=
# Test processes: each simulates 4 CPU devices and takes whole test modules (loadfile), so
# a module's fixtures are built once.
TEST_WORKERS ?= 2

.PHONY: help install test train train-multiprocess eval prepare bench bench-quick bench-plot \
	accelerator-check gpu-check tpu-check lint format lock stacks which-python clean

# The first target, so `make` alone lists the targets (their `## ` comments) and variables.
help: ## this list (what `make` alone prints)
	@echo "haiku_state: make <target> [VARIABLE=value ...], e.g. make train EXP=mlp"
	@echo
	@echo "Targets:"
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  %-19s%s\n", $$1, $$2}' $(firstword $(MAKEFILE_LIST))
	@echo
	@echo "Variables:"
	@printf '  %-9s%s\n' \
		EXP "an experiment of experiments/: $(EXPERIMENTS), or resnet50:imagenet (now $(EXP))" \
		WORKDIR "the run's directory, runs/<EXP> by default; train resumes the run there (now $(WORKDIR))" \
		DEVICES "CPU devices to simulate; a GPU or TPU host uses all its own (now $(DEVICES))" \
		ARGS "more flags, e.g. ARGS=\"--config.steps=800\"; --helpconfig lists the config keys" \
		PYTHON "the interpreter, which picks the stack: $(STACKS) (now $(or $(PYTHON),none found: set PYTHON=))" \
		VENV "the virtualenv it installs into; VENV= runs PYTHON as it is (now $(VENV))"
	@echo "  Others: PROCESSES, PORT (train-multiprocess), FROM, TO (prepare), RECORD (bench,"
	@echo "  the checks), ACCELERATOR (cuda12, cuda13, tpu), TEST_WORKERS; see the Makefile."

install: $(call installed,test+bench+plots) ## create VENV and install everything at the lock's versions

ifneq ($(VENV),)
# Without the build backend's banner on every editable install (a warning about folders named
# as the package: noise to whoever runs make).
$(STAMP_PREFIX)%: export PYTHONWARNINGS := ignore:Editable installation
$(STAMP_PREFIX)%: setup.cfg pyproject.toml $(wildcard $(LOCK))
	@test -f $(LOCK) || { echo "No lock file $(LOCK) for Python $(STACK); the stacks are: $(STACKS)" >&2; exit 1; }
	$(PY) -c 'import sys; assert sys.version_info[:2] == ($(subst .,$(comma),$(STACK)))' 2>/dev/null \
		|| $(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(LOCK) -e '.[$(subst +,$(comma),$*)]' $(JAX_PLUGIN)
	touch $@
endif

test: $(call installed,test+bench+plots) ## the test suite, on 4 simulated CPU devices
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

train: $(call installed,plots) ## train EXP in WORKDIR on DEVICES devices (resumes the run there)
	$(PY) -m haiku_state.train --config=$(CONFIG) --workdir=$(WORKDIR) \
		--cpu_devices=$(DEVICES) $(ARGS)

train-multiprocess: $(call installed,plots) ## train EXP with PROCESSES local processes of DEVICES devices each
	@status=0; pids=""; \
	for k in $$(seq 0 $$(($(PROCESSES) - 1))); do \
		$(PY) -m haiku_state.train --config=$(CONFIG) --workdir=$(WORKDIR) \
			--cpu_devices=$(DEVICES) --coordinator_address=127.0.0.1:$(PORT) \
			--num_processes=$(PROCESSES) --process_id=$$k $(ARGS) & pids="$$pids $$!"; \
	done; \
	for pid in $$pids; do wait $$pid || status=1; done; exit $$status

eval: $(call installed,plots) ## evaluate WORKDIR's latest checkpoint (ARGS="--step=N" or "--step=best")
	$(PY) -m haiku_state.train --config=$(CONFIG) --workdir=$(WORKDIR) \
		--cpu_devices=$(DEVICES) --mode=eval $(ARGS)

prepare: $(call installed,plots) ## convert FROM (imagefolder:DIR, cifar10:DIR, digits) to ArrayRecord shards in TO
	$(PY) -m haiku_state.prepare --from="$(FROM)" --to="$(TO)" $(ARGS)

# RECORD=benchmarks/results/<platform>.json also keeps the run as the platform's curated
# record and writes its table into benchmarks/README.md.
bench: $(call installed,bench+plots) ## throughput benchmarks (benchmarks/README.md); RECORD= keeps the record
	$(PY) -m benchmarks.run $(if $(RECORD),--record=$(RECORD) --update_readme) $(ARGS)

bench-quick: $(call installed,bench+plots) ## the benchmarks, cut short (a smoke run)
	$(PY) -m benchmarks.run --quick $(ARGS)

bench-plot: $(call installed,bench+plots) ## charts of the benchmark records in benchmarks/results
	$(PY) -m benchmarks.plot $(ARGS)

# One check of an accelerator host in 8 minutes (benchmarks/accelerator_check.py): the
# ImageNet recipe's start-up cold and with the compilation cache, steps at the plan's
# batch sizes, MFU, decoders, the loop. On a host that has JAX and its plugin:
# `make tpu-check VENV= RECORD=benchmarks/results/tpu.json` (gpu-check: a GPU's plan).
accelerator-check: $(call installed,bench+plots) ## one 8-minute check of an accelerator host (benchmarks/accelerator_check.py)
	$(PY) -m benchmarks.accelerator_check $(if $(RECORD),--out=$(RECORD)) $(ARGS)

gpu-check: ARGS += --plan=gpu
gpu-check: accelerator-check ## the check with the GPU plan

tpu-check: ARGS += --plan=tpu
tpu-check: accelerator-check ## the check with the TPU plan

lint: $(call installed,test) ## ruff check and format check
	$(PY) -m ruff check haiku_state experiments tests benchmarks
	$(PY) -m ruff format --check haiku_state experiments tests benchmarks

format: $(call installed,test) ## ruff format and fix
	$(PY) -m ruff format haiku_state experiments tests benchmarks
	$(PY) -m ruff check --fix haiku_state experiments tests benchmarks

# Every stack's lock file, resolved afresh from setup.cfg in throwaway virtualenvs;
# pins already there are kept unless UPGRADE=1 (requirements/lock.sh).
lock: ## the lock files requirements/py*.txt from setup.cfg (UPGRADE=1: afresh)
	@for v in $(STACKS); do \
		p=$$($(call find_python,$$v)) || { echo "make lock: no Python $$v runs here" >&2; exit 1; }; \
		requirements/lock.sh "$$p" requirements/py$$v.txt || exit 1; \
	done

# The stacks, newest first, and the Python make picks (`make -s which-python STACKS=3.11`:
# that stack's, or an error when it is not here).
stacks: ## the Python versions with a lock file, newest first
	@echo $(STACKS)

which-python: ## the Python make picks
	@echo $(PYTHON)

clean: ## delete VENV and the caches (runs/ and its checkpoints are kept)
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
