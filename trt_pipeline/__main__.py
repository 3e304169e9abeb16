"""`python -m trt_pipeline` and the `trt-pipeline` command: the command line, then an exit that waits for no thread.

A command that loads and runs a model runs in a child this process watches (cli.run_watched): a native crash or the
out-of-memory killer then ends the command with an error that says so, not with silence.

Python waits at exit for every thread not marked daemon: one that a model's factory (or its forward) started and left
running made a finished build print `done` and never exit, holding `make` and a CI job forever.  The pipeline's own
work is over when the command returns, so such a thread is named, and the process exits without it.
"""

import logging
import os
import sys
import threading

from trt_pipeline.pipeline.cli import main, run_watched, watched


def run() -> None:
    if watched(sys.argv[1:]):
        sys.exit(run_watched(sys.argv[1:]))
    status = main()
    this = threading.current_thread()
    left = [thread.name for thread in threading.enumerate() if thread is not this and not thread.daemon]
    if not left:
        sys.exit(status)
    print(
        f"warning: the command finished but thread(s) {left} still run: the model's code (its factory or forward) "
        "started them, not the pipeline; exiting without waiting for them (start them with daemon=True, or stop "
        "them before the factory returns)",
        file=sys.stderr,
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    run()
