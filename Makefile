# Thin layer over `python -m pipeline`; every target sets up .venv first if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

MODEL ?= resnet
PRECISION ?= fp16
BATCH ?= 1:8:32
OUT ?= engines
WEIGHTS ?=
INPUT_SHAPE ?=
DYNAMIC ?=
CALIB ?=
CALIB_METHOD ?= percentile
FORCE ?=
RECALIBRATE ?=
BACKENDS ?=
BATCHES ?=
TARGET ?=
KEEP_FP32 ?=
NO_AUTO_FP32 ?=

PIPELINE_ARGS = --model '$(MODEL)' --precision $(PRECISION) --batch $(BATCH) --out '$(OUT)' \
	$(if $(WEIGHTS),--weights '$(WEIGHTS)') $(if $(INPUT_SHAPE),--input-shape '$(INPUT_SHAPE)') \
	$(if $(DYNAMIC),--dynamic '$(DYNAMIC)') $(if $(CALIB),--calib '$(CALIB)' --calib-method $(CALIB_METHOD)) \
	$(if $(FORCE),--force) $(if $(RECALIBRATE),--recalibrate) $(if $(TARGET),--target '$(TARGET)') \
	$(if $(KEEP_FP32),--keep-fp32 '$(KEEP_FP32)') $(if $(NO_AUTO_FP32),--no-auto-fp32)

.PHONY: venv engine bench serve calibration-images accuracy test lint typecheck clean

# torch==2.13.0 first: on these machines that is the CPU build on disk; a bare `torch`
# requirement would pull the newest CUDA build (several GB).  tensorrt-stubs goes in with
# --no-deps because it depends on the full tensorrt, which only NVIDIA's index serves.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[rtx,dev]'
	$(PY) -m pip install -q --no-deps tensorrt-stubs==10.13.0.35.1
	$(PY) tools/trt_stubs.py $(VENV)/typings
	touch $@

venv: $(STAMP)

engine: $(STAMP)
	$(PY) -m pipeline all $(PIPELINE_ARGS)

# Latency of engines/<model>-<precision>/ through every backend usable here (BACKENDS=a,b to choose,
# BATCHES=1,8,32 within the profile); writes bench.json/.md/.png into that folder.
bench: $(STAMP)
	$(PY) -m pipeline bench --model '$(MODEL)' --precision $(PRECISION) --out '$(OUT)' \
		$(if $(BACKENDS),--backends $(BACKENDS)) $(if $(BATCHES),--batches $(BATCHES))

# HTTP inference on engines/<MODEL>-<PRECISION> (loopback unless HOST is set): make serve MODEL=resnet PORT=8000
HOST ?= 127.0.0.1
PORT ?= 8000
serve: $(STAMP)
	$(PY) -m pipeline serve --model '$(MODEL)' --precision $(PRECISION) --out '$(OUT)' --host $(HOST) --port $(PORT)

# Real photographs shipped inside scikit-image / scikit-learn, as a calibration folder for image models
# (git-ignored): make engine MODEL=resnet PRECISION=int8 CALIB=calibration/samples
calibration-images: $(STAMP)
	$(PY) -m calibration.photos --out calibration/samples

# Top-1 of FP32, FP16 and INT8 (every calibration method) on MODEL's labelled held-out set (MODEL=digits),
# or for other models agreement with FP32 on CALIB; writes accuracy.json/.md into engines/<model>-fp32/.
accuracy: $(STAMP)
	$(PY) -m pipeline accuracy --model '$(MODEL)' --out '$(OUT)' $(if $(WEIGHTS),--weights '$(WEIGHTS)') \
		$(if $(CALIB),--calib '$(CALIB)') $(if $(RECALIBRATE),--recalibrate)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The code that only runs with the full tensorrt is checked against tensorrt-stubs.
typecheck: $(STAMP)
	$(PY) -m mypy pipeline models calibration

test: lint typecheck
	$(PY) -m pytest -q

clean:
	rm -rf $(OUT)
