import sys

from trt_pipeline.pipeline.cli import main

sys.exit(main())
