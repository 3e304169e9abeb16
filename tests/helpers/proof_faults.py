"""A child entry point for the proving tests (pipeline.runners.proving.Isolation.entry): it proves a candidate as the
real one does, except that for a graph named in PROOF_FAULTS (a JSON object, graph -> "segfault" or "hang") it dies
of SIGSEGV or never finishes, as a child whose candidate hits a CUDA fault does.  Each start appends the graph it was
asked for to the file PROOF_STARTS names, so a test sees how many children a load started."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from trt_pipeline.pipeline.runners import proving

FAULTS, STARTS = "PROOF_FAULTS", "PROOF_STARTS"


def main(argv: list[str]) -> int:
    graph = json.loads(argv[1])["graph"]
    if os.environ.get(STARTS):
        with open(os.environ[STARTS], "a") as starts:
            starts.write(f"{graph}\n")
    fault = json.loads(os.environ.get(FAULTS, "{}")).get(graph)
    if fault == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "hang":
        time.sleep(3600)
    return proving.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
