#!/usr/bin/env bash
# What the GPU machine runs, in three chained device calls (the machine goes back after 30 s idle,
# and /tmp survives between calls only while it stays warm).  Prepare first, here:
#     python tools/device/bundle.py
# then, through the device tool, from the repository root, one call right after the other:
#     carry .devbundle/a:  bash tools/device/run.sh start   # environment; pycuda starts building (detached)
#     carry .devbundle/b:  bash tools/device/run.sh main    # install, SM 9.0 probe, pytest -m gpu, ResNet-50 FP16
#     (no carry):          bash tools/device/run.sh bench   # make bench at batch 1/8/32: torch rows and the engine's
# Every log and JSON lands in $OUT.
set -uo pipefail
PY=/opt/torch/.venv/bin/python3
[ -x "$PY" ] || PY=python3
SITE=/tmp/site
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
export CUDA_ROOT="${CUDA_ROOT:-/usr/local/cuda}" PATH="/usr/local/cuda/bin:$PATH"
OUT="${OUT:?run through the device tool, which sets OUT}"
ENGINES=/tmp/engines

install_wheels() {  # into $SITE, no index, no dependencies (each is named in the bundle)
	"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
}

start() {
	{
		nvidia-smi
		"$PY" --version
		"$PY" -m pip list 2>/dev/null | grep -iE '^(torch|onnx|onnxruntime|numpy|cuda-bindings|cuda-python|cupy)'
		include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
		if [ -f "$include/Python.h" ]; then echo "Python headers: present ($include)"; else echo "Python headers: MISSING ($include)"; fi
		nvcc --version | tail -2
		grep -m1 'model name' /proc/cpuinfo
	} >"$OUT/env.txt" 2>&1
	mkdir -p /tmp/bundle && cp -r .devbundle/a /tmp/bundle/
	install_wheels /tmp/bundle/a/*.whl
	# Detached (setsid), so the build goes on after this call returns; `main` waits for it.
	setsid bash -c "\"$PY\" -m pip install -v --no-index --no-deps --no-build-isolation --no-cache-dir \
		--target /tmp/site-pycuda /tmp/bundle/a/pycuda-*.tar.gz >/tmp/pycuda.log 2>&1; echo \$? >/tmp/pycuda.rc" \
		</dev/null >/dev/null 2>&1 &
	cat "$OUT/env.txt"
}

main() {
	cp -r .devbundle/b /tmp/bundle/
	local wheel
	wheel=$(awk '{print $2}' /tmp/bundle/b/SHA256SUMS)
	cat "/tmp/bundle/a/$wheel.part0" "/tmp/bundle/b/$wheel.part1" >"/tmp/bundle/$wheel"
	(cd /tmp/bundle && sha256sum -c b/SHA256SUMS) 2>&1 | tee "$OUT/wheel-sha256.txt"
	install_wheels "/tmp/bundle/$wheel" /tmp/bundle/b/*.whl
	"$PY" tools/device/probe.py .devbundle/b/aot/toy_models-tiny_cnn-fp32 "$OUT" >"$OUT/probe.log" 2>&1
	echo "probe: exit $?"
	# The ResNet-50 FP16 engine builds while pycuda finishes and the GPU tests run.
	("$PY" -m trt_pipeline all --model resnet --precision fp16 --out "$ENGINES" \
		>/tmp/engine-fp16.log 2>&1; echo $? >/tmp/engine-fp16.rc) &
	while [ ! -f /tmp/pycuda.rc ]; do sleep 2; done
	echo "pycuda build: exit $(cat /tmp/pycuda.rc)"; tail -c 3000 /tmp/pycuda.log >"$OUT/pycuda-build-tail.log"
	[ "$(cat /tmp/pycuda.rc)" = 0 ] && export PYTHONPATH="$SITE:/tmp/site-pycuda:$PWD"
	"$PY" -m pytest -m gpu -v -rs -p no:cacheprovider tests/test_device_memory_gpu.py tests/test_runner_gpu.py >"$OUT/pytest-gpu.log" 2>&1
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

"$@"
