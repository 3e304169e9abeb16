"""On the GPU machine, issue 54: why the sweep's ConvNeXt and BERTs are where they are.

    python tools/device/triage.py convnext FOLDER OUT    # each runner variant in a child: which one crashes
    python tools/device/triage.py fusion FOLDER OUT      # a BERT-style folder served with and without the
                                                         # runner's transformer fusion, rows alternating

The sweep's ConvNeXt passed auto's host check in a child process (FP32 graph, CUDA graphs, NHWC, bias split), then
its process died (SIGSEGV) at its first batch of 8 beside torch; the FP16 graph failed there with an illegal address.
`convnext` opens the onnxruntime-cuda runner on each graph with one option changed at a time, each in a process of
its own (a CUDA fault is sticky), runs batches 1, 8 and 32 twenty times each, and records how each ended.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "defaults": {"cuda_graph": True},
    "nchw": {"cuda_graph": True, "provider_options": {"prefer_nhwc": "0"}},
    "no-bias-split": {"cuda_graph": True, "split_conv_bias": False},
    "no-cuda-graph": {"cuda_graph": False},
    "heuristic-search": {"cuda_graph": True, "provider_options": {"cudnn_conv_algo_search": "HEURISTIC"}},
    "nchw-no-graph": {"cuda_graph": False, "provider_options": {"prefer_nhwc": "0"}},
}


# (graph, variant, torch first): every variant on the FP32 graph auto served, the main ones on the FP16 graph
RUNS = [("model.onnx", name, False) for name in VARIANTS] + [("model.onnx", "defaults", True)]
RUNS += [("model.fp16.onnx", name, False) for name in ("defaults", "nchw", "no-bias-split", "no-cuda-graph")]


def convnext(folder: Path, out: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def child(run: tuple[str, str, bool]) -> tuple[str, dict]:
        graph, name, torch_first = run
        command = [sys.executable, __file__, "variant", str(folder), graph, json.dumps(VARIANTS[name])]
        command += ["torch"] if torch_first else []
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            ended, tail = done.returncode, (done.stdout + done.stderr)[-800:]
        except subprocess.TimeoutExpired:
            ended, tail = "timeout", ""
        label = f"{graph} {name}{' torch-first' if torch_first else ''}"
        return label, {"exit": ended, "s": round(time.perf_counter() - started, 1), "tail": tail}

    results = {}
    with ThreadPoolExecutor(4) as pool:  # 4 processes share the GPU: a fault stays in its own
        for label, result in pool.map(child, RUNS):
            results[label] = result
            last = result["tail"].strip().splitlines()[-1] if result["tail"].strip() else ""
            print(f"{label:45} exit {result['exit']}  {last}"[:300], flush=True)
            (out / "triage-convnext.json").write_text(json.dumps(results, indent=1))


def variant(folder: Path, graph: str, options: dict, torch_first: bool) -> None:
    from trt_pipeline.pipeline.runners import load_runner

    rng = np.random.default_rng(0)
    if torch_first:  # torch's CUDA context and cuDNN in use first, as in the sweep's process
        import torch
        import torchvision

        model = torchvision.models.convnext_tiny().cuda().eval()
        with torch.no_grad(), torch.autocast("cuda", torch.float16):
            model(torch.randn(8, 3, 224, 224, device="cuda"))
        torch.cuda.synchronize()
    with load_runner(folder, "onnxruntime-cuda", graph=graph, **options) as runner:
        print(runner.description[:300])
        for batch in (1, 8, 32):
            images = rng.standard_normal((batch, 3, 224, 224), dtype=np.float32)
            first = runner.infer({"input": images})["output"]
            for _ in range(20):
                last = runner.infer({"input": images})["output"]
            print(f"batch {batch}: finite {bool(np.isfinite(last).all())}, repeat max abs {np.abs(last - first).max()}")
    print("ok")


def fusion(folder: Path, out: Path) -> None:
    """The onnxruntime-cuda runner as auto opens it (CUDA graphs where ONNX Runtime captures) with its transformer
    fusion (pipeline.runners.attention) and without it (fuse_attention=False), and fused with its numpy inputs and
    outputs through page-locked copies (pinned_copies=True, what straight copies were measured against), rows
    alternating in one process: p50 ms end to end at batch 1, 8 and 32 (sequence 128), and how far apart the fused
    and unfused outputs are.  On a host without the CUDA provider (a dry run) the same runner on the CPU placement,
    uncaptured."""
    import onnxruntime as ort

    from trt_pipeline.pipeline.runners import load_runner
    from trt_pipeline.pipeline.runners.onnxruntime_cuda import CaptureRefused

    on_gpu = "CUDAExecutionProvider" in ort.get_available_providers()
    place = {"cuda_graph": True} if on_gpu else {"device": "cpu"}

    def opened(**options: bool):  # noqa: ANN202 - a runner
        try:
            return load_runner(folder, "onnxruntime-cuda", **options, **place)
        except CaptureRefused:  # nodes on the CPU: uncaptured, as auto opens it then
            return load_runner(folder, "onnxruntime-cuda", **options)

    rng = np.random.default_rng(0)
    runners = {
        "fused": opened(),
        "as exported": opened(fuse_attention=False),
        "fused, pinned copies": opened(pinned_copies=True),
    }
    report: dict = {name: runner.description for name, runner in runners.items()}
    for batch in (1, 8, 32) if on_gpu else (1, 2):
        feed = {"input_ids": rng.integers(1, 20000, (batch, 128)), "attention_mask": np.ones((batch, 128), np.int64)}
        feed["attention_mask"][-1, 100:] = 0  # a padded row: the mask matters
        if "token_type_ids" in (spec.name for spec in runners["fused"].inputs):  # BERT's: a sentence pair
            feed["token_type_ids"] = np.repeat((np.arange(128) >= 64)[None], batch, axis=0).astype(np.int64)
        outputs = {name: runner.infer(feed) for name, runner in runners.items()}
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(60 if on_gpu else 3):
            for name, runner in runners.items():
                started = time.perf_counter()
                runner.infer(feed)
                times[name].append((time.perf_counter() - started) * 1e3)
        first = next(iter(outputs["fused"]))
        apart = np.abs(outputs["fused"][first] - outputs["as exported"][first])[feed["attention_mask"] == 1]
        report[f"batch {batch}"] = {
            **{f"{name} p50 ms": round(float(np.median(t[len(t) // 6 :])), 3) for name, t in times.items()},
            f"{first} max abs apart (unpadded tokens)": float(apart.max()),
        }
        print(f"batch {batch}: {report[f'batch {batch}']}", flush=True)
    for runner in runners.values():
        runner.close()
    (out / "triage-fusion.json").write_text(json.dumps(report, indent=1))


def placement(folder: Path, out: Path) -> None:
    """ONNX Runtime's verbose log of a CUDA session on the FP16 graph, kept where it says where each node runs and
    which copies it adds: a Memcpy node is what stops a CUDA graph capture (the sweep's BERTs ran without one).
    Beside it, the reads of host values pipeline.runners.shape_values predicts, and the same log for the graph as the
    runner rewrites it (those values made on the device): the prediction checked against ONNX Runtime's own."""
    import shutil

    import onnx

    from trt_pipeline.pipeline.runners.shape_values import host_reads, make_on_device

    graph = folder / "model.fp16.onnx"
    rewritten = folder / "placement-triage.fp16.onnx"  # beside the graph: its weights' references hold
    shutil.copyfile(graph, rewritten)
    made = make_on_device(rewritten)
    report = [
        f"predicted host reads: {host_reads(onnx.load(str(graph), load_external_data=False))}",
        f"made on the device by the runner's rewrite: {made}; predicted after: "
        f"{host_reads(onnx.load(str(rewritten), load_external_data=False))}",
    ]
    for name, path in (("as built", graph), ("as the runner rewrites it", rewritten)):
        lines = _placement_lines(path)
        copies = [line for line in lines if "Memcpy nodes are added" in line or "MemcpyFromHost" in line]
        report += [f"--- {name}: {len(copies)} lines naming added copies", *copies, *lines[-40:]]
    rewritten.unlink()
    (out / "triage-placement.txt").write_text("\n".join(report) + "\n")
    print("\n".join(report))


def _placement_lines(graph: Path) -> list[str]:
    """The placement and Memcpy lines of ONNX Runtime's verbose log opening `graph` on the CUDA provider."""
    opening = (
        "import onnxruntime as ort, sys; options = ort.SessionOptions(); options.log_severity_level = 0; "
        "ort.InferenceSession(sys.argv[1], options, providers=['CUDAExecutionProvider', 'CPUExecutionProvider'])"
    )
    done = subprocess.run([sys.executable, "-c", opening, str(graph)], capture_output=True, text=True, timeout=120)
    # Its placement lines (each node by op type and name, under the provider's) come from one function; the
    # copies from the Memcpy transformer.
    return [line for line in done.stderr.splitlines() if "VerifyEachNodeIsAssignedToAnEp" in line or "emcpy" in line]


if __name__ == "__main__":
    verb, args = sys.argv[1], sys.argv[2:]
    if verb == "variant":
        variant(Path(args[0]), args[1], json.loads(args[2]), torch_first=len(args) > 3)
    else:
        {"convnext": convnext, "fusion": fusion, "placement": placement}[verb](Path(args[0]), Path(args[1]))
