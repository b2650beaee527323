"""On `PYTHONPATH` for one test: a `megatron-tail serve-local` started with it fails as an engine that runs
out of memory while it loads (exit 1, its own error as its log's last line); every other process starts as
usual. Python imports `sitecustomize` at start-up, after `sys.argv` is set."""

import os
import sys

if "serve-local" in sys.argv:
    print("torch.OutOfMemoryError: out of memory while loading the model (this test's fault)", flush=True)
    os._exit(1)  # SystemExit here would be reported by `site` as an error in sitecustomize
