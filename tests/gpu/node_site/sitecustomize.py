"""Put on PYTHONPATH by `tests/test_gpu_cpu_halves.py` only: every Python process started under it imports a
GPU node's packages alone and records the lines of tests/gpu it runs (`tests/gpu/node_imports.py`)."""

import sys
from pathlib import Path

try:
    from tests.gpu.node_imports import install_from_environment
except ImportError:  # a process whose PYTHONPATH lost the checkout: last on the path, as a fallback
    sys.path.append(str(Path(__file__).resolve().parents[3]))
    from tests.gpu.node_imports import install_from_environment

install_from_environment()
