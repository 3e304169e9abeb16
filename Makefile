# Thin layer over `python -m trt_pipeline`; every target sets up .venv first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Errors then name make variables (CALIB=...) rather than options (--calib); see pipeline/core/mentions.py.
PIPELINE := TRT_PIPELINE_FRONT_END=make $(PY) -m trt_pipeline

# The settings `make engine` passes on, declared once in pipeline/core/settings.py (tests/core/test_settings.py
# checks these lists and the defaults below against it).  Each reaches the command line as the option named
# from the variable: CALIB_METHOD=x as '--calib-method=x', NO_FLOAT_SEARCH=1 as --no-float-search.  A value
# is passed once it is set, to nothing too (MODEL= is refused, not replaced by the default); a switch once it
# is not empty.  The defaults below are the ones bench and serve share; every other one is Python's.
SETTING_VALUES := MODEL PRECISION BATCH WEIGHTS INPUT_SHAPE DYNAMIC OUT WORKSPACE_MIB BUILDER EXPORTER TARGET \
	KEEP_FP32 CALIB CALIB_METHOD CALIB_SAMPLES CALIB_BATCH SMOOTH POSTPROCESS NMS_BOX_FORMAT NMS_SCORE_THRESHOLD \
	NMS_IOU_THRESHOLD NMS_CANDIDATES NMS_MAX_DETECTIONS NMS_HEAD
SETTING_SWITCHES := NO_AUTO_FP32 TRUST_MODEL_FILE RECALIBRATE STRICT_CALIB NO_FLOAT_SEARCH FORCE NMS_CLASS_AGNOSTIC
MODEL ?= resnet
PRECISION ?= fp16
BATCH ?= 1:8:32
OUT ?= engines
BACKENDS ?=
BATCHES ?=
HOST ?= 127.0.0.1
PORT ?= 8000
GRPC_PORT ?= 8001
# Not exported: make would expand a command-line variable to put it into every recipe's environment,
# running a $(shell ...) inside it.  The values reach Python as arguments only (arg, below).
unexport $(SETTING_VALUES) $(SETTING_SWITCHES) BACKENDS BATCHES HOST PORT GRPC_PORT ACCURACY_BUDGET

# Every value reaches Python as one argument, whatever it holds: $(value) stops make from expanding a
# $(...) inside it, the single quotes stop the shell, and each ' in it becomes '\'' (close, escaped
# quote, reopen).  --name=value keeps argparse from reading a value such as -1:2:3 as an option.
# A line break is the one thing quoting cannot carry: make runs each line of a recipe on its own, so a value
# holding one would reach the shell cut in two.  Such a value stops make before anything runs.
define newline


endef
one_line = $(if $(findstring $(newline),$(value $(1))),$(error error: $(1) holds a line break; fix: give $(1) on one line))
arg = $(call one_line,$(2))'--$(1)=$(subst ','\'',$(value $(2)))'
# The option of a variable (a name of ours, never a value): lower case, _ as -.
option = $(shell printf %s '$(1)' | tr A-Z_ a-z-)
# Given: not empty, or set on the command line or in the environment even as nothing (unexport defines the rest).
given = $(or $(value $(1)),$(filter-out file default undefined,$(origin $(1))))
# No $(strip): it would squeeze the spaces inside a value.
PIPELINE_ARGS = $(foreach name,$(SETTING_VALUES),$(if $(call given,$(name)),$(call arg,$(call option,$(name)),$(name)))) \
	$(foreach name,$(SETTING_SWITCHES),$(if $(value $(name)),--$(call option,$(name))))

.PHONY: venv engine bench serve calibration-images accuracy test lint typecheck clean

# torch==2.13.0 first: on these machines that is the CPU build on disk; a bare `torch`
# requirement would pull the newest CUDA build (several GB).  tensorrt-stubs goes in with
# --no-deps because it depends on the full tensorrt, which only NVIDIA's index serves.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	@# Both ONNX Runtime wheels own the `onnxruntime` folder: remove either before installing one, so a
	@# venv that had the other one never ends with a broken import (pip check does not notice).
	$(PY) -m pip uninstall -q -y onnxruntime onnxruntime-gpu
	$(PY) -m pip install -q -e '.[all,dev]'
	$(PY) -m pip install -q --no-deps tensorrt-stubs==10.13.0.35.1
	$(PY) -m pip install -q --no-deps 'nvidia-pytriton~=0.7'  # the [tritonserver] extra, without its numpy<2 pin
	$(PY) tools/trt_stubs.py $(VENV)/typings
	touch $@

venv: $(STAMP)

engine: $(STAMP)
	$(PIPELINE) engine $(PIPELINE_ARGS)

# Latency of engines/<model>-<precision>/ through every backend usable here, the one `serve` runs included
# (BACKENDS=a,b to choose, BATCHES=1,8,32 within the profile); writes bench.json/.md/.png into that folder,
# with a stability verdict (python -m trt_pipeline bench --help: iterations, rounds, --agree-within).
bench: $(STAMP)
	$(PIPELINE) bench $(call arg,model,MODEL) $(call arg,precision,PRECISION) $(call arg,out,OUT) \
		$(if $(value BACKENDS),$(call arg,backends,BACKENDS)) $(if $(value BATCHES),$(call arg,batches,BATCHES))

# Triton's protocol (KServe v2) on engines/<MODEL>-<PRECISION>, REST on PORT and gRPC on GRPC_PORT (0: none),
# loopback unless HOST is set: make serve MODEL=resnet PORT=8000 GRPC_PORT=8001
serve: $(STAMP)
	$(PIPELINE) serve $(call arg,model,MODEL) $(call arg,precision,PRECISION) $(call arg,out,OUT) \
		$(call arg,host,HOST) $(call arg,port,PORT) $(call arg,grpc-port,GRPC_PORT)

# Real photographs shipped inside scikit-image / scikit-learn, as a calibration folder for image models
# (git-ignored): make engine MODEL=resnet PRECISION=int8 CALIB=calibration/samples
calibration-images: $(STAMP)
	$(PIPELINE) calibration-images --out calibration/samples

# Top-1 of FP32, FP16 and INT8 (each method CALIB_METHOD names: auto's percentile and max by default) on MODEL's
# labelled held-out set (MODEL=digits), or for other models agreement with FP32 on CALIB; writes accuracy.json/.md
# into engines/<model>-fp32/.
accuracy: $(STAMP)
	$(PIPELINE) accuracy $(call arg,model,MODEL) $(call arg,out,OUT) $(if $(value WEIGHTS),$(call arg,weights,WEIGHTS)) \
		$(if $(value CALIB),$(call arg,calib,CALIB)) $(if $(value CALIB_METHOD),$(call arg,calib-method,CALIB_METHOD)) \
		$(if $(value RECALIBRATE),--recalibrate) \
		$(if $(value ACCURACY_BUDGET),$(call arg,accuracy-budget,ACCURACY_BUDGET))

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The code that only runs with the full tensorrt is checked against tensorrt-stubs.
typecheck: $(STAMP)
	$(PY) -m mypy trt_pipeline

test: lint typecheck
	$(PY) -m pytest -q

clean:
	rm -rf -- '$(subst ','\'',$(value OUT))'
