# make run   : set up, then run the whole pipeline (dvc repro) on the embedded default data
# make test  : set up, then run the default test suite
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed

export PATH := $(BIN):$(PATH)
export DVC_NO_ANALYTICS := 1
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PYTHONUNBUFFERED := 1

.PHONY: setup run test test-fast test-slow docs docs-build promote lint tensorboard clean sanity inspect lr-find review-label-errors train-join
.PHONY: serve serve-venv reload predict add-data add-weights warm-start commit-run check-reproduced reproduce push pull review
.PHONY: experiments sweep gpu-check
.PHONY: prefect-server prefect-pool prefect-deploy prefect-worker prefect-run prefect-up prefect-stop prefect-status

# The pins are for Python 3.11: another Python is refused before a venv is made (pip would fail minutes later).
# PYTHON=/path/to/python3.11 names one; an existing venv keeps its own Python.
CHECK_PYTHON = { test -n "$(PYTHON)" && "$(PYTHON)" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; } || \
	{ echo "error: PYTHON=$(PYTHON) is not Python 3.11 (the pinned requirements need 3.11); install python3.11 or name one: make PYTHON=/path/to/python3.11 ..." >&2; exit 2; }

$(STAMP): requirements.txt constraints.txt
	@test -x $(BIN)/python || { $(CHECK_PYTHON); $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt -c constraints.txt
	@touch $(STAMP)

# The serving process's own venv: serving/requirements.txt only (onnxruntime, numpy, pillow, FastAPI),
# no torch, pyarrow, dvc or prefect. make serve runs from it; the real-server tests start it too.
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed
$(SERVE_STAMP): serving/requirements.txt constraints.txt
	@test -x $(SERVE_VENV)/bin/python || { $(CHECK_PYTHON); $(PYTHON) -m venv $(SERVE_VENV); }
	$(SERVE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SERVE_VENV)/bin/python -m pip install --quiet -r serving/requirements.txt -c constraints.txt
	@touch $(SERVE_STAMP)

serve-venv: $(SERVE_STAMP)

# A fresh clone (or an unpacked tarball) gets the git and DVC state that `dvc repro` needs.
setup: $(STAMP)
	@test -d .git || git init --quiet
	@test -d .dvc || $(BIN)/dvc init --quiet
	@$(BIN)/dvc config core.analytics false

run: setup
	$(BIN)/dvc repro
	@$(BIN)/python -m tasks.tools.recompute
	@$(BIN)/python -m tasks.tools.summary

# Two pytest workers, each taking whole test files (module fixtures stay built once); the ten slowest tests
# are printed. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: setup serve-venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=10

test-slow: setup serve-venv
	$(BIN)/python -m pytest -m slow

# The CUDA paths no CPU test runs (fp16 + GradScaler, bf16, resume, ONNX on CUDA, auto_batch on a real OOM), one
# table in a few minutes on a GPU (bench/gpu_check.py); without a CUDA device it says so and exits 0.
gpu-check: setup
	$(BIN)/python bench/gpu_check.py

# The edit loop: the unit-level tests only (marker `fast`, pyproject.toml), under 3 minutes on 2 cores.
# make test stays the full default suite.
test-fast: setup
	$(BIN)/python -m pytest -m 'fast and not slow and not gpu'

# The docs site (mkdocs.yml, docs/): served on 127.0.0.1 with live reload, or built once with --strict
# into site/ (what .ci/run checks).
DOCS_PORT ?= 8000
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a 127.0.0.1:$(DOCS_PORT)

docs-build: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# After a run, commit what DVC recorded, as DVC intends: dvc.lock, the .gitignore and .dvc files it
# wrote, the uncached metrics and plots in reports/, and the params they came from. Then
# `dvc metrics diff`, `dvc params diff` and `dvc exp show` compare against this run; `dvc push` shares
# the cached outputs. Nothing is committed when nothing changed.
# It refuses a record that is not this workspace's run (a stage DVC says is not up to date, a verdict for
# another ONNX or baseline, a failed export gate: tasks/tools/record.py), a failed or incomparable gate (the way
# past one is `make promote ACCEPT="<why>"`, recorded), a verdict `dvc exp run` recorded without enforcing it, a
# model trained with test hooks (tasks/release/gate.py), and a file a stage depends on that is changed but not
# staged (tasks/tools/commit_run.py). A commit that keeps a promotion names who decided it, and why.
MSG ?= pipeline run: dvc.lock and reports
export MSG
commit-run: setup
	@$(BIN)/python -m tasks.tools.commit_run
	git add $$($(BIN)/python -m tasks.tools.commit_run --staged-paths)
	@if git diff --cached --quiet; then echo "nothing to commit: this run is already the committed one"; \
	else git commit -q -m "$$($(BIN)/python -m tasks.tools.commit_run --message "$$MSG")" && git log --oneline -1; fi

# `dvc push` / `dvc pull` to the default DVC remote, with one clear line when they fail.
push: setup
	$(BIN)/python scripts/dvc_sync.py push

pull: setup
	$(BIN)/python scripts/dvc_sync.py pull

# Does this checkout's last run reproduce the committed one? identical; the same environment but other
# bytes (a bug, by stage and file); or another environment (named, with metric deltas, within tolerance).
# Only outputs this workspace computed are judged (the run ledger, runs/ledger.jsonl): pulled, checked-out
# or run-cache outputs are "not recomputed here", exit 1.
check-reproduced: setup
	$(BIN)/python scripts/lock_diff.py HEAD

# Reproduce a committed run (REV, default HEAD) for real: a scratch git worktree of REV, only its inputs
# (.dvc-tracked data, weights, baseline) from this cache or the DVC remote, every stage recomputed with the
# run cache off, compared with REV's record. This workspace is not touched (scripts/reproduce.py).
REV ?= HEAD
reproduce: setup
	$(BIN)/python scripts/reproduce.py "$(REV)"

# Your ImageFolder as versioned data: NAME= copies it to data/raw/$(NAME), `dvc add`s it and points params.yaml's
# data.source at it; INTO= merges new images into the existing data/raw/$(INTO) (duplicates skipped, conflicts
# refused, `dvc add`ed again, data.source unchanged; SRC=data/review is then emptied of what it took).
# Then commit the .dvc file (the command prints what to add) and `dvc push`.
add-data: setup
	@test -n "$(SRC)" || { echo "error: SRC is missing: make add-data SRC=/path/to/images NAME=pets" >&2; exit 2; }
	@test -n "$(NAME)$(INTO)" || { echo "error: NAME or INTO is missing: make add-data SRC=$(SRC) NAME=pets (a new dataset) or INTO=pets (grow data/raw/pets)" >&2; exit 2; }
	@test -z "$(NAME)" || test -z "$(INTO)" || { echo "error: NAME=$(NAME) and INTO=$(INTO) both given: NAME makes a new dataset, INTO grows an existing one; give one" >&2; exit 2; }
	$(BIN)/python -m tasks.tools.add_data "$(SRC)" $(if $(INTO),--into "$(INTO)","$(NAME)")

# torchvision's published weights for train.pretrained, as a DVC-tracked file in models/pretrained/: `dvc import-url`
# of its URL (internet needed), or SRC=/path/to/the/file to `dvc add` a copy you have. Checked against the hash in
# torchvision's file name; params.yaml's train.arch and train.pretrained are set. Then commit and `dvc push`.
WEIGHTS ?= DEFAULT
add-weights: setup
	@test -n "$(ARCH)" || { echo "error: ARCH is missing: make add-weights ARCH=resnet18 [WEIGHTS=IMAGENET1K_V1] [SRC=file], or ARCH=timm/<name> [WEIGHTS=<tag>] [REVISION=<commit>]" >&2; exit 2; }
	$(BIN)/python -m tasks.tools.add_weights "$(ARCH)" --weights "$(WEIGHTS)" $(if $(SRC),--src "$(SRC)") $(if $(URL),--url "$(URL)") $(if $(REVISION),--revision "$(REVISION)")

# The production model's weights (the promoted baseline's, else the last export's; its sha256 checked against the
# ONNX) into paths.parent, `dvc add`ed: what train.warm_start.enabled starts the next training from. Then commit
# models/parent/model.pt.dvc and parent.json, `dvc push`.
warm-start: setup
	$(BIN)/python -m tasks.tools.warm_start

# Make this run's exported model (hash-verified) and its test metrics the baseline that
# check_regression compares against; baseline/ files are `dvc add`ed. The gate then runs again against
# the new baseline, so dvc.lock records it as DVC would (`dvc status` stays clean): then make commit-run.
# A failed or incomparable gate (a regression, a class joined, other preprocessing) needs ACCEPT="<why>":
# the reason, the verdict set aside, who and when go to baseline/decision.json, the registry and the commit.
# ACCEPT counts only on the command line (a shell that exported one accepts nothing), with `$` kept as typed.
PROMOTE_ACCEPT := $(if $(filter command line,$(origin ACCEPT)),$(value ACCEPT))
promote: setup
	@IMAGEPIPE_ACCEPT='$(subst ','\'',$(PROMOTE_ACCEPT))' $(BIN)/python -m tasks.tools.promote --accept-from-env

# The experiment table: the MLflow UI on 127.0.0.1:<tracking.ui_port> (params.yaml), offline, over mlflow.db beside
# the project (or MLFLOW_TRACKING_URI). Every run that reached the gate is one row with its lineage; a sweep is a
# parent with its trials as children; make promote's model is the registry's alias `production` (docs: Experiments).
experiments: setup
	$(BIN)/python -m tasks.tools.experiments

# An Optuna study over params.yaml's sweep.space, each trial a DVC experiment in its own temporary copy, run by the
# sweep-flow (flows/sweep_flow.py) on the project's Prefect server when it answers, else on a temporary one.
# TRIALS= the study's size, PARALLEL= trials at once, STUDY= its name (runs/sweep/<study>.journal; the same
# command resumes a killed sweep). It prints the best trial and its `dvc exp apply` line.
sweep: setup
	@source scripts/prefect-env.sh; \
	if ! curl -fsS -o /dev/null --max-time 3 "$$PREFECT_API_URL/health" 2>/dev/null; then \
		echo "(no Prefect server answers at $$PREFECT_API_URL: the sweep runs on a temporary one; make prefect-server keeps its runs)"; \
		unset PREFECT_API_URL; fi; \
	$(BIN)/python -m flows.sweep_flow $(if $(TRIALS),--trials "$(TRIALS)") $(if $(PARALLEL),--parallel "$(PARALLEL)") $(if $(STUDY),--study "$(STUDY)")

lint: setup
	$(BIN)/ruff check tasks flows serving tests bench
	$(BIN)/ruff format --check tasks flows serving tests bench

# Training across nodes (train.nnodes > 1, docs/scale-out.md): the head node runs `dvc repro train`,
# which waits at train.rdzv_endpoint; every other node, in its own checkout of the same commit with
# the shards pulled (`dvc pull preprocess`) and paths.checkpoints on the shared storage, runs this.
train-join: setup
	$(BIN)/python -m tasks.train --join

# Overfit one training batch with the train recipe: a loss that won't reach ~0 means a broken code or
# data path, not bad hyperparameters (params: sanity.*; needs the shards: dvc repro preprocess).
sanity: setup
	$(BIN)/python -m tasks.tools.sanity

# When a model misbehaves (docs/debugging.md): a layer trace of one real training batch (forward and
# backward hooks on every module -> reports/inspect.json), and the learning-rate range test
# (reports/lr_find.json + .png, and the `dvc exp run -S train.lr=...` to try). ARGS: the tools' flags.
inspect: setup
	$(BIN)/python -m tasks.tools.layer_trace $(ARGS)

lr-find: setup
	$(BIN)/python -m tasks.tools.lr_find $(ARGS)

# The likeliest label errors of reports/label_errors.json into the review folder (TOP=30).
TOP ?= 30
review-label-errors: setup
	$(BIN)/python -m tasks.tools.review_label_errors --top $(TOP)

# The review page on 127.0.0.1:<serve.review_port> (params.yaml), offline; open the URL it prints (its token keeps
# other local users out): label the review folder by keyboard,
# discard, undo, fix label-error candidates inside the dataset, take the labelled images in (the add-data merge into
# INTO=, default the data/raw/<name> that data.source is in) and accept the gate's decision. Every decision goes to
# data/raw/<name>.decisions.jsonl (append-only; without a tracked dataset <review_dir>/.decisions.jsonl).
review: setup
	$(BIN)/python -m tasks.tools.review $(if $(INTO),--into "$(INTO)")

# The production ONNX model (baseline/ from make promote, else models/model.onnx), hash-verified,
# behind FastAPI on serve.host:serve.port (params.yaml `serve`). docs/serving.md.
serve: serve-venv
	$(SERVE_VENV)/bin/python -m serving

# After `make promote`: every worker of the running server (serve.host:serve.port) loads the new production model,
# verifies its hash and swaps it in; the old one serves until then, and stays when the new one is refused. Sends
# the token the server wrote to <paths.runs>/serve/<port>/token; needs only the serving venv (docs: Serving).
reload: serve-venv
	@$(SERVE_VENV)/bin/python scripts/reload_server.py

# Classify images without a server: SRC=<image or folder> -> OUT (predictions.csv), one row per file, from the
# torch-free serving venv and the server's code path (MODEL= another ONNX; default what make serve serves).
# make exits 2 on any failure ("Error N" names the module's code: 1 none, 2 bad arguments, 3 some not classified,
# 4 a bug); a script that acts on the code runs .venv-serve/bin/python -m serving.predict itself (docs/serving.md).
OUT ?= predictions.csv
predict: serve-venv
	@test -n "$(SRC)" || { echo "error: SRC is missing: make predict SRC=<image or folder> [OUT=predictions.csv]" >&2; exit 2; }
	@$(SERVE_VENV)/bin/python -m serving.predict "$(SRC)" --out "$(OUT)" $(if $(MODEL),--model "$(MODEL)")

tensorboard: setup
	$(BIN)/tensorboard --logdir runs --host 127.0.0.1

# Prefect, in order: server (127.0.0.1:4200, SQLite in .prefect/), work pool, deployments from
# prefect.yaml + the crash automation, worker. Settings: scripts/prefect-env.sh. docs/prefect.md.
prefect-server: setup
	scripts/prefect.sh server

prefect-pool: setup
	scripts/prefect.sh pool

prefect-deploy: setup
	scripts/prefect.sh deploy

# POOL=gpu on the machine that runs the stages prefect.yaml's placement puts there (docs/scale-out.md)
POOL ?= local-process
prefect-worker: setup
	POOL=$(POOL) LIMIT=$(LIMIT) scripts/prefect.sh worker

# A deployment's run, followed to its end: its final state and message, exit 1 unless it Completed.
DEPLOYMENT ?= train-flow/prod
# PARAMS="train_retries=2 push=false": flow parameters (make takes -p as its own flag, so they go through PARAMS).
prefect-run: setup
	scripts/prefect.sh run $(DEPLOYMENT) $(foreach kv,$(PARAMS),-p $(kv))

prefect-up: prefect-server prefect-pool prefect-deploy prefect-worker

prefect-stop:
	scripts/prefect.sh stop

prefect-status:
	scripts/prefect.sh status

clean:
	rm -rf runs .pytest_cache
