"""pytest setup for the Python package's tests (tests/python/): `import kiln` from a build.

ctest's `python` test sets PYTHONPATH to the build's python/ folder; run by hand, the first of
build/python and build-dev/python that holds a built kiln is used, unless kiln is importable
already (pip install .)."""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "examples", "onnx"))  # torch_models.py: the models torch_step_test uses

try:
    import kiln  # noqa: F401
except ImportError:
    for build in ("build", "build-dev"):
        folder = os.path.join(ROOT, build, "python")
        if os.path.isdir(os.path.join(folder, "kiln")):
            sys.path.insert(0, folder)
            break

try:
    import torch
    torch.set_num_threads(1)  # CI's 2 cores run ctest -j2
except ImportError:
    pass
