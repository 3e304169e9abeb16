"""One check shared by the CPU and GPU runner tests: many threads, each must get its own result."""

from __future__ import annotations

import threading

from trt_pipeline.pipeline.core.compare import compare_outputs


def assert_each_thread_gets_its_own_result(runner, feeds: list[dict], calls: int = 20) -> None:
    """Run every feed alone first, then all at once from len(feeds) threads, `calls` times each."""
    expected = [runner.infer(feed) for feed in feeds]
    failures: list[str] = []
    start = threading.Barrier(len(feeds))  # release every thread together, so calls really overlap

    def work(index: int) -> None:
        start.wait()
        for call in range(calls):
            results = compare_outputs(expected[index], runner.infer(feeds[index]), rtol=1e-6)
            if not all(c.ok for c in results.values()):
                failures.append(f"thread {index} call {call}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(feeds))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
