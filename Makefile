# Thin layer over `python -m trt_pipeline`; every target sets up .venv first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Errors then name make variables (CALIB=...) rather than options (--calib); see pipeline/cli.py.
PIPELINE := TRT_PIPELINE_FRONT_END=make $(PY) -m trt_pipeline

MODEL ?= resnet
PRECISION ?= fp16
BATCH ?= 1:8:32
OUT ?= engines
WEIGHTS ?=
INPUT_SHAPE ?=
DYNAMIC ?=
EXPORTER ?=
CALIB ?=
CALIB_METHOD ?= auto
SMOOTH ?=
FORCE ?=
RECALIBRATE ?=
STRICT_CALIB ?=
BACKENDS ?=
BATCHES ?=
TARGET ?=
KEEP_FP32 ?=
NO_AUTO_FP32 ?=
NO_FLOAT_SEARCH ?=
TRUST_MODEL_FILE ?=
HOST ?= 127.0.0.1
PORT ?= 8000
GRPC_PORT ?= 8001
# Not exported: make would expand a command-line variable to put it into every recipe's environment,
# running a $(shell ...) inside it.  The values reach Python as arguments only (arg, below).
unexport MODEL PRECISION BATCH OUT WEIGHTS INPUT_SHAPE DYNAMIC EXPORTER CALIB CALIB_METHOD SMOOTH FORCE RECALIBRATE STRICT_CALIB \
	BACKENDS BATCHES TARGET KEEP_FP32 NO_AUTO_FP32 NO_FLOAT_SEARCH TRUST_MODEL_FILE HOST PORT GRPC_PORT

# Every value reaches Python as one argument, whatever it holds: $(value) stops make from expanding a
# $(...) inside it, the single quotes stop the shell, and each ' in it becomes '\'' (close, escaped
# quote, reopen).  --name=value keeps argparse from reading a value such as -1:2:3 as an option.
# A line break is the one thing quoting cannot carry: make runs each line of a recipe on its own, so a value
# holding one would reach the shell cut in two.  Such a value stops make before anything runs.
define newline


endef
one_line = $(if $(findstring $(newline),$(value $(1))),$(error error: $(1) holds a line break; fix: give $(1) on one line))
arg = $(call one_line,$(2))'--$(1)=$(subst ','\'',$(value $(2)))'
PIPELINE_ARGS = $(call arg,model,MODEL) $(call arg,precision,PRECISION) $(call arg,batch,BATCH) $(call arg,out,OUT) \
	$(if $(value WEIGHTS),$(call arg,weights,WEIGHTS)) $(if $(value INPUT_SHAPE),$(call arg,input-shape,INPUT_SHAPE)) \
	$(if $(value DYNAMIC),$(call arg,dynamic,DYNAMIC)) $(if $(value EXPORTER),$(call arg,exporter,EXPORTER)) $(if $(value CALIB),$(call arg,calib,CALIB) $(call arg,calib-method,CALIB_METHOD)) \
	$(if $(value SMOOTH),$(call arg,smooth,SMOOTH)) $(if $(value NO_FLOAT_SEARCH),--no-float-search) \
	$(if $(value FORCE),--force) $(if $(value RECALIBRATE),--recalibrate) $(if $(value STRICT_CALIB),--strict-calib) $(if $(value TARGET),$(call arg,target,TARGET)) \
	$(if $(value KEEP_FP32),$(call arg,keep-fp32,KEEP_FP32)) $(if $(value NO_AUTO_FP32),--no-auto-fp32) \
	$(if $(value TRUST_MODEL_FILE),--trust-model-file)

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

# Top-1 of FP32, FP16 and INT8 (every calibration method) on MODEL's labelled held-out set (MODEL=digits),
# or for other models agreement with FP32 on CALIB; writes accuracy.json/.md into engines/<model>-fp32/.
accuracy: $(STAMP)
	$(PIPELINE) accuracy $(call arg,model,MODEL) $(call arg,out,OUT) $(if $(value WEIGHTS),$(call arg,weights,WEIGHTS)) \
		$(if $(value CALIB),$(call arg,calib,CALIB)) $(if $(value RECALIBRATE),--recalibrate) \
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
