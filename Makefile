# pdtool: `make demo` sets everything up and runs the main job; `make test` runs the tests
# (`make test-fast`: those that start no worker process).
# Both create (or reuse) a virtual environment in .venv, install pdtool with torch 2.13.0 (CPU) and
# the test, hf and plot extras (pytest, transformers, matplotlib), and install Debian's graphviz where they can.

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c  # `pd train ... | tee` fails when pd train does

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PD := $(VENV)/bin/pd
STAMP := $(VENV)/.pdtool-installed
OUT ?= out

.PHONY: demo test test-fast install graphviz profiles bench clean

install: $(STAMP)

# Left out of the install's compileall (7 s of its 24 on 2 cores): the installed packages' own tests, pip, and
# transformers' model families other than those pdtool's zoo, examples and tests build. Any of them still imports
# (compiled as it is imported).
NEVER_IMPORTED = /(tests|pip)/|/transformers/models/(?!(auto|bert|deberta|deberta_v2|encoder_decoder|gemma2|gpt2|llama|mamba|mistral|mixtral|qwen2|t5|vit)/|__init__\.py$$)

$(STAMP): setup.cfg pyproject.toml Makefile  # Makefile: the extras it installs
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.[test,hf,plot]'
	# pip byte-compiles on one core; compileall on every core (14 s less on 2 cores). A file that does not compile
	# (pip skips those too) only imports slower, so its status is ignored.
	$(PY) -m compileall -q -j 0 -x '$(NEVER_IMPORTED)' $(VENV)/lib >/dev/null || true
	touch $@

# Rendering falls back to .dot files with a warning when `dot` is missing, so failing here is not fatal.
graphviz:
	@command -v dot >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
	      || echo "warning: could not install graphviz; pictures will be written as .dot sources" >&2; \
	  else \
	    echo "warning: graphviz's dot is missing (install it: sudo apt-get install graphviz); pictures will be .dot sources" >&2; \
	  fi; }

# The demo: profile an MLP, plan it as a straight pipeline for up to 4 local CPU workers (the cost
# model alone would pick data parallelism on so fast a link), draw and simulate the plan, then
# train it with PipeDream's 1F1B and weight stashing on the UCI digits shipped with pdtool and
# report the held-out accuracy beside the predicted and measured time per minibatch.
PD_MODEL_demo = pdtool.zoo:mlp
PD_ARGS_demo = -a in_features=64 -a hidden=1024 -a depth=3 -a classes=10 -b 64 --repeats 5 --threads 1
PD_CLUSTER_demo = 4x2GB/s
PD_PLAN_ARGS_demo = --straight

DEMO_EPOCHS ?= 20

demo: install graphviz
	@mkdir -p $(OUT)
	$(MAKE) --no-print-directory PD=$(PD) $(OUT)/demo.profile.json $(OUT)/demo.plan.json $(OUT)/demo.svg
	$(PD) show $(OUT)/demo.profile.json --top 5
	$(PD) show $(OUT)/demo.plan.json
	$(PD) simulate $(OUT)/demo.plan.json --trace $(OUT)/demo.trace.json
	rm -rf $(OUT)/demo.checkpoints
	$(PD) train $(OUT)/demo.plan.json --data digits --epochs $(DEMO_EPOCHS) --lr 0.1 --momentum 0.5 --threads 1 \
	    --evaluate --metrics $(OUT)/demo.metrics.csv --trace $(OUT)/demo.train-trace.json \
	    --checkpoint-dir $(OUT)/demo.checkpoints | tee $(OUT)/demo.train.log
	$(PD) plot $(OUT)/demo.metrics.csv -o $(OUT)/demo.loss.png
	@echo
	@echo "== demo summary =="
	@grep -E "^(held-out|time per minibatch)" $(OUT)/demo.train.log | sed 's/^/  /'
	@echo "  profile           $(OUT)/demo.profile.json"
	@echo "  plan              $(OUT)/demo.plan.json"
	@echo "  picture           $$(ls $(OUT)/demo.svg 2>/dev/null || echo '$(OUT)/demo.dot (graphviz missing)')"
	@echo "  simulated trace   $(OUT)/demo.trace.json   (open traces in https://ui.perfetto.dev)"
	@echo "  measured trace    $(OUT)/demo.train-trace.json"
	@echo "  metrics           $(OUT)/demo.metrics.csv"
	@echo "  loss curve        $(OUT)/demo.loss.png"
	@echo "  checkpoint        $$(ls -d $(OUT)/demo.checkpoints/step-* | tail -1)"

# pdtool's own bytecode, where PYTHONDONTWRITEBYTECODE keeps Python from writing it as it imports: 0.35 s of every
# process that imports pdtool otherwise (launchers, forkservers, benches: hundreds in the suite); incremental
BYTECODE = $(PY) -m compileall -q -j 0 src tests bench >/dev/null || true

test: install graphviz
	$(BYTECODE)
	$(PY) -m pytest -q -m "not workers and not slow" -n auto
	$(PY) -m pytest -q -m "workers or slow" -n auto --durations=15

# The fast tier for your loop: every test that starts no worker process and takes milliseconds (tests/README.md).
test-fast: install graphviz
	$(BYTECODE)
	$(PY) -m pytest -q -m "not workers and not slow" -n auto

# ----- shipped profiles, measured on this machine: `make profiles` regenerates them all -----
PROFILES := mlp vgg16-small vgg16 resnet50-small resnet50 gpt-small gpt
PD_MODEL_mlp = pdtool.zoo:mlp
PD_ARGS_mlp = -b 64
PD_MODEL_vgg16-small = pdtool.zoo:vgg16
PD_ARGS_vgg16-small = -a width=16 -a image_size=64 -a hidden=256 -a classes=10 -b 16
PD_MODEL_vgg16 = pdtool.zoo:vgg16
PD_ARGS_vgg16 = -b 8 --repeats 5
PD_MODEL_resnet50-small = pdtool.zoo:resnet50
PD_ARGS_resnet50-small = -a width=16 -a image_size=64 -a classes=10 -b 16
PD_MODEL_resnet50 = pdtool.zoo:resnet50
PD_ARGS_resnet50 = -b 8 --repeats 5
PD_MODEL_gpt-small = pdtool.zoo:gpt
PD_ARGS_gpt-small = -a vocab=1024 -a seq_len=128 -a d_model=256 -a heads=4 -a layers=4 -b 8
PD_MODEL_gpt = pdtool.zoo:gpt
PD_ARGS_gpt = -a seq_len=128 -b 4 --repeats 5

profiles: install
	$(MAKE) --no-print-directory -B PD=$(PD) $(PROFILES:%=profiles/%.profile.json)

# Every benchmark docs/benchmarks.md quotes, each writing its dated result file into bench/results/
# (about 60 minutes here; run it alone, on a quiet machine). real_links needs root for its network
# namespaces and says so where it cannot make them.
BENCHES := profile_speed plan_speed train_speed recompute big_model startup time_to_accuracy real_links test_time
bench: install
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[plot]'
	set -e; for b in $(BENCHES); do $(PY) bench/$$b.py; done
	@if $(PY) -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then $(PY) bench/gpu.py; \
	  else echo "bench/gpu.py skipped: this torch sees no CUDA GPU"; fi

clean:
	rm -rf $(OUT) .pytest_cache

include cli/pd.mk
