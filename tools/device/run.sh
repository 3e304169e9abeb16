#!/usr/bin/env bash
# What the GPU machine runs, in three chained device calls (the machine goes back after 30 s idle,
# and /tmp survives between calls only while it stays warm).  Prepare first, here:
#     python tools/device/bundle.py
# then, through the device tool, from the repository root, one call right after the other:
#     carry .devbundle/a:  bash tools/device/run.sh start   # environment; pycuda starts building (detached)
#     carry .devbundle/b:  bash tools/device/run.sh main    # install, SM 9.0 probe, pytest -m gpu, ResNet-50 FP16
#     (no carry):          bash tools/device/run.sh bench   # make bench at batch 1/8/32: torch rows and the engine's
# onnxruntime-gpu (python tools/device/bundle.py ort: two folders, ort0 with onnxsim), one call a part, then the
# install, all while warm:
#     carry .devbundle/ort0: bash tools/device/run.sh ort_part    (likewise ort1)
#     (no carry):           bash tools/device/run.sh ort_install  # join, sha256 check, install, CUDA provider check
# Issue 23 (our graphs on ONNX Runtime's CUDA provider, tools/device/ort_cuda.py; then with five parts of the whole
# wheel), one chain while warm:
#     carry .devbundle/a:                  bash tools/device/run.sh start_bare
#     carry .devbundle/b:                  bash tools/device/run.sh ort_builds   # RTX probe; folders build detached
#     carry .devbundle/ort0, then ort1:    bash tools/device/run.sh ort_part     (one call each)
#     (no carry):                          bash tools/device/run.sh ort_install
#     (no carry):                          bash tools/device/run.sh ort_measure  # detached; then, until it says done:
#     (no carry):                          bash tools/device/run.sh ort_collect  # waits, then results.tar.gz in $OUT
# Issue 36 (python tools/device/bundle.py ort: onnxruntime-gpu with Hopper's kernels only, and onnxsim, in two
# folders), one chain while warm:
#     carry .devbundle/ort0: bash tools/device/run.sh served_start    # environment, onnxsim; the folders build detached
#     carry .devbundle/ort1: bash tools/device/run.sh served_measure  # onnxruntime-gpu; detached: GPU tests, bench,
#                                                                     # memory per captured graph, batch-32 kernels
#     (no carry):            bash tools/device/run.sh ort_collect     # waits (WAIT_S, 540), then results.tar.gz in $OUT
# Issue 54 (benchmarks/gpu_models.py: the sweep built by make_engine, served by load_runner, beside torch), one group
# a session (SWEEP=1..6: gpu_models.py GROUPS; or MODELS=a,b), python tools/device/bundle.py ort first, two calls:
#     carry .devbundle/ort0, timeout_s 120: SWEEP=1 bash tools/device/run.sh sweep_start  # environment, onnxsim
#     carry .devbundle/ort1, timeout_s 600: SWEEP=1 bash tools/device/run.sh sweep        # onnxruntime-gpu, the group
# (here, with no GPU: OUT=/tmp/out PY=.venv/bin/python SWEEP=dry DRY=1 bash tools/device/run.sh sweep_measure)
# Its triage (tools/device/triage.py): sweep_start as above, then carry .devbundle/ort1: bash tools/device/run.sh triage
# Every log and JSON lands in $OUT.
set -uo pipefail
PY=${PY:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
SITE=/tmp/site
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
export CUDA_ROOT="${CUDA_ROOT:-/usr/local/cuda}" PATH="/usr/local/cuda/bin:$PATH"
OUT="${OUT:?run through the device tool, which sets OUT}"
ENGINES=/tmp/engines
ORT_PARTS=/tmp/bundle/ort
ORT_SITE=/tmp/site-ort  # apart from $SITE: builds running detached keep the venv's onnxruntime
RESULTS=/tmp/results

# onnxruntime-gpu's CUDA provider loads cudart/cublas/cudnn 13 by name: the torch cu130 venv's nvidia-* packages
# hold them.  Every call exports the path, since each call is a new shell.
cuda_libs=$("$PY" -c 'import glob, site; print(":".join(sorted(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib"))))' 2>/dev/null)
export LD_LIBRARY_PATH="${cuda_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

install_wheels() {  # into $SITE, no index, no dependencies (each is named in the bundle)
	"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
}

machine_env() {
	{
		nvidia-smi
		"$PY" --version
		"$PY" -m pip list 2>/dev/null | grep -iE '^(torch|onnx|onnxruntime|numpy|cuda-bindings|cuda-python|cupy)'
		include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
		if [ -f "$include/Python.h" ]; then echo "Python headers: present ($include)"; else echo "Python headers: MISSING ($include)"; fi
		nvcc --version | tail -2
		grep -m1 'model name' /proc/cpuinfo
		"$PY" -m pip show nvidia-cudnn-cu13 nvidia-cublas nvidia-cuda-runtime 2>&1 | grep -E '^(Name|Version)'
	} >"$OUT/env.txt" 2>&1
}

start() {
	machine_env
	mkdir -p /tmp/bundle && cp -r .devbundle/a /tmp/bundle/
	install_wheels /tmp/bundle/a/*.whl
	# Detached (setsid), so the build goes on after this call returns; `main` waits for it.
	setsid bash -c "\"$PY\" -m pip install -v --no-index --no-deps --no-build-isolation --no-cache-dir \
		--target /tmp/site-pycuda /tmp/bundle/a/pycuda-*.tar.gz >/tmp/pycuda.log 2>&1; echo \$? >/tmp/pycuda.rc" \
		</dev/null >/dev/null 2>&1 &
	cat "$OUT/env.txt"
}

rtx_install() {  # TensorRT-RTX (its libs wheel joined from a/ and b/) and onnxsim; then the SM 9.0 probe
	cp -r .devbundle/b /tmp/bundle/
	local wheel
	wheel=$(awk '{print $2}' /tmp/bundle/b/SHA256SUMS)
	cat "/tmp/bundle/a/$wheel.part0" "/tmp/bundle/b/$wheel.part1" >"/tmp/bundle/$wheel"
	(cd /tmp/bundle && sha256sum -c b/SHA256SUMS) 2>&1 | tee "$OUT/wheel-sha256.txt"
	install_wheels "/tmp/bundle/$wheel" /tmp/bundle/b/*.whl
	"$PY" tools/device/probe.py .devbundle/b/aot/toy_models-tiny_cnn-fp32 "$OUT" >"$OUT/probe.log" 2>&1
	echo "probe: exit $?"
}

main() {
	rtx_install
	# The ResNet-50 FP16 engine builds while pycuda finishes and the GPU tests run.
	("$PY" -m trt_pipeline all --model resnet --precision fp16 --out "$ENGINES" \
		>/tmp/engine-fp16.log 2>&1; echo $? >/tmp/engine-fp16.rc) &
	while [ ! -f /tmp/pycuda.rc ]; do sleep 2; done
	echo "pycuda build: exit $(cat /tmp/pycuda.rc)"; tail -c 3000 /tmp/pycuda.log >"$OUT/pycuda-build-tail.log"
	[ "$(cat /tmp/pycuda.rc)" = 0 ] && export PYTHONPATH="$SITE:/tmp/site-pycuda:$PWD"
	"$PY" -m pytest -m gpu -v -rs -p no:cacheprovider tests/gpu/test_device_memory.py tests/gpu/test_tensorrt.py >"$OUT/pytest-gpu.log" 2>&1
	echo "pytest -m gpu: exit $?"; tail -15 "$OUT/pytest-gpu.log"
	wait
	echo "engine fp16: exit $(cat /tmp/engine-fp16.rc)"; tail -12 /tmp/engine-fp16.log
}

bench() {
	[ -f /tmp/pycuda.rc ] && [ "$(cat /tmp/pycuda.rc)" = 0 ] && export PYTHONPATH="$SITE:/tmp/site-pycuda:$PWD"
	local backends=torch-amp,torch-compile,onnxruntime,tensorrt,tensorrt-v2,tensorrt-graphs
	"$PY" -m trt_pipeline bench --folder "$ENGINES/resnet50-fp16" --batches 1,8,32 --backends "$backends" \
		--budget-s 2 --report-dir "$OUT/fp16" 2>&1 | tail -40
}

start_bare() {  # the environment, and the first half of the TensorRT-RTX libs wheel (no pycuda: not needed)
	machine_env
	cat "$OUT/env.txt"
}

ort_builds() {
	ort_part
	rtx_install
	mkdir -p "$RESULTS"
	setsid bash -c "\"$PY\" tools/device/ort_cuda.py build /tmp/engines /tmp/bundle/b/photos >$RESULTS/build.log 2>&1; \
		echo \$? >/tmp/build.rc" </dev/null >/dev/null 2>&1 &
}

ort_measure() {  # after the builds: the onnxruntime-cuda runner's GPU tests, speed, then the FP16 and INT8 checks,
	# detached (a call lasts 10 minutes at most)
	setsid bash -c "while [ ! -f /tmp/build.rc ]; do sleep 2; done; export PYTHONPATH=$ORT_SITE:$PYTHONPATH; \
		\"$PY\" -m pytest -m gpu -v -rs -p no:cacheprovider tests/gpu/test_onnxruntime_cuda.py \
		>$RESULTS/pytest-gpu.log 2>&1; \
		for step in speed fp16 int8; do \"$PY\" tools/device/ort_cuda.py \$step /tmp/engines $RESULTS \
		>$RESULTS/\$step.log 2>&1; done; echo done >/tmp/measure.done" </dev/null >/dev/null 2>&1 &
}

ort_collect() {  # wait (up to WAIT_S, 9 minutes by default) for the measurements, then bring back what there is
	local waited=0
	while [ ! -f /tmp/measure.done ] && [ $waited -lt "${WAIT_S:-540}" ]; do sleep 5; waited=$((waited + 5)); done
	[ -f /tmp/measure.done ] && echo "measurements: done" || echo "measurements: still running"
	tail -n 5 "$RESULTS"/*.log
	tar -czf "$OUT/results.tar.gz" -C "$RESULTS" .
}

served_start() {  # issue 36: the ResNet-50 and encoder FP16 folders build (CPU) while the next part travels
	machine_env
	cat "$OUT/env.txt"
	ort_part
	install_wheels "$ORT_PARTS"/onnxsim-*.whl
	build_detached resnet50-fp16 encoder-fp16
}

build_detached() {  # the folders NAMES build (CPU) after this call returns, from a copy of the code: the next call's
	# copy of the tree lands while they import (it once removed a module under them: "No module named ...parity")
	rm -rf /tmp/code && mkdir -p /tmp/code "$RESULTS" && cp -r trt_pipeline pipeline models calibration tools tests /tmp/code/
	setsid bash -c "cd /tmp/code && PYTHONPATH=$SITE:/tmp/code \"$PY\" tools/device/ort_cuda.py build $ENGINES \
		/nonexistent $* >$RESULTS/build.log 2>&1; echo \$? >/tmp/build.rc" </dev/null >/dev/null 2>&1 &
}

served_measure() {  # issue 36: onnxruntime-gpu, its CUDA provider placing a node, then served_launch
	ort_part
	ort_install || return 1
	grep -q "^smoke: \['CUDAExecutionProvider'" "$OUT/ort-providers.txt" || { echo "smoke failed: not measuring"; return 1; }
	served_launch
}

served_launch() {  # detached: the GPU tests, then once the folders are built the bench on both (ROWS, see
	# ort_cuda.py), ResNet-50's device memory per captured graph and its kernels at batch 32 beside torch.compile's;
	# /tmp/measure.done when all is done
	setsid bash -c "export PYTHONPATH=$ORT_SITE:$PYTHONPATH ROWS=${ROWS:-}; \
		bash tools/device/run.sh served_tests; \
		while [ ! -f /tmp/build.rc ]; do sleep 2; done; \
		BUDGET_S=1 \"$PY\" tools/device/ort_cuda.py speed $ENGINES $RESULTS resnet50-fp16 encoder-fp16 \
		>$RESULTS/speed.log 2>&1; \
		for step in graph_memory profile; do \"$PY\" tools/device/ort_cuda.py \$step $ENGINES $RESULTS \
		>$RESULTS/\$step.log 2>&1; done; echo done >/tmp/measure.done" </dev/null >/dev/null 2>&1 &
}

served_tests() {  # the onnxruntime-cuda runner's GPU tests (serve_fixtures needs tritonclient, which is not there)
	PYTHONPATH="$ORT_SITE:$PYTHONPATH" "$PY" -m pytest -m gpu -v -rs -p no:cacheprovider -p no:tests.helpers.serve_fixtures \
		tests/gpu/test_onnxruntime_cuda.py tests/gpu/test_device_memory.py >"$RESULTS/pytest-gpu.log" 2>&1
	echo "pytest -m gpu: exit $?"; tail -25 "$RESULTS/pytest-gpu.log"
}

sweep_start() {  # issue 54: the environment, and onnxsim (the folders' simplify stage) from the first part
	machine_env
	cat "$OUT/env.txt"
	ort_part
	install_wheels "$ORT_PARTS"/onnxsim-*.whl
}

sweep() {  # issue 54: onnxruntime-gpu from both parts, its CUDA provider placing a node, then the group
	ort_part
	ort_install || return 1
	grep -q "^smoke: \['CUDAExecutionProvider'" "$OUT/ort-providers.txt" || { echo "smoke failed: not measuring"; return 1; }
	sweep_measure
}

sweep_measure() {  # group SWEEP (or MODELS), each model built then measured in a process of its own; cut at
	# SWEEP_S (480 s) so that the call (600 s, the install first) returns what was measured (the JSON: after each model)
	local which name
	if [ -n "${MODELS:-}" ]; then
		which=(--models "$MODELS") name="gpu-models-${MODELS//,/-}"
	else
		which=(--group "${SWEEP:?SWEEP=1..6 (or MODELS=a,b) names the models}") name="gpu-models-$SWEEP"
	fi
	PYTHONPATH="$ORT_SITE:$PYTHONPATH" timeout "${SWEEP_S:-480}" "$PY" benchmarks/gpu_models.py ${DRY:+--dry-run} \
		"${which[@]}" --engines "$ENGINES" --out "$OUT/$name" --model-timeout-s "${MODEL_S:-420}"
	echo "sweep: exit $?"
	tail -n 60 "$OUT/$name.md"
}

triage() {  # issue 54, second call of a session (after sweep_start): onnxruntime-gpu, DistilBERT's sweep row,
	# then tools/device/triage.py on its folder (fusion, placement) and on a ConvNeXt folder built meanwhile (each
	# step cut short)
	ort_part
	ort_install || return 1
	export PYTHONPATH="$ORT_SITE:$PYTHONPATH"
	setsid bash -c "timeout 120 \"$PY\" benchmarks/gpu_models.py --models convnext --build-only --engines /tmp/triage \
		--out /tmp/triage/build >/tmp/triage-build.log 2>&1; echo \$? >/tmp/triage-build.rc" </dev/null >/dev/null 2>&1 &
	MODELS=distilbert SWEEP_S=${SWEEP_S:-130} MODEL_S=125 sweep_measure
	timeout 60 "$PY" tools/device/triage.py fusion "$ENGINES/distilbert-fp16" "$OUT" >"$OUT/triage-fusion.log" 2>&1
	echo "fusion: exit $?"; tail -c 1500 "$OUT/triage-fusion.log"
	timeout 60 "$PY" tools/device/triage.py placement "$ENGINES/distilbert-fp16" "$OUT" | grep -v "All nodes placed"
	while [ ! -f /tmp/triage-build.rc ]; do sleep 2; done
	echo "convnext build: exit $(cat /tmp/triage-build.rc)"
	timeout 75 "$PY" tools/device/triage.py convnext /tmp/triage/sweep_models-convnext_tiny-fp16 "$OUT" 2>&1
}

ort_part() {  # the part(s) this call carried, kept in /tmp while the machine stays warm
	mkdir -p "$ORT_PARTS" && cp .devbundle/ort*/* "$ORT_PARTS/"
	ls -l "$ORT_PARTS"
}

ort_join() {  # the wheel from its parts, checked against the sha256 taken before it was split
	local wheel
	wheel=$(awk '{print $2}' "$ORT_PARTS/SHA256SUMS")
	# shellcheck disable=SC2046  # part names hold no spaces
	cat $(ls "$ORT_PARTS/$wheel".part* | sort -V) >"$ORT_PARTS/$wheel"
	(cd "$ORT_PARTS" && sha256sum -c SHA256SUMS) 2>&1 | tee "$OUT/ort-wheel-sha256.txt"
}

ort_install() {
	ort_join || return 1
	"$PY" -m pip show nvidia-cudnn-cu13 nvidia-cublas nvidia-cuda-runtime 2>&1 | grep -E '^(Name|Version)' \
		>"$OUT/ort-cuda-libs.txt"
	echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$OUT/ort-cuda-libs.txt"
	"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$ORT_SITE" \
		"$ORT_PARTS"/onnxruntime_gpu-*.whl
	PYTHONPATH="$ORT_SITE:$PYTHONPATH" "$PY" -c 'import onnxruntime as ort; print(ort.__version__, ort.__file__, ort.get_available_providers())' \
		2>&1 | tee "$OUT/ort-providers.txt"
	# A session that must place every node on CUDA: the provider's libraries load (or their error shows here).
	PYTHONPATH="$ORT_SITE:$PYTHONPATH" ORT_CUDA_SMOKE=1 "$PY" -c 'from tools.device.ort_cuda import smoke; smoke()' \
		2>&1 | tee -a "$OUT/ort-providers.txt"
}

"$@"
