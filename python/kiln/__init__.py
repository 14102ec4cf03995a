"""kiln, a training compiler, from Python (docs/python.md).

    step = kiln.compile(model, (x, y), optimizer=kiln.AdamW(lr=1e-3))   # a torch module or an ONNX file
    loss = step(x, y)                                                    # one training step, the loss as a tensor
    kiln.train(model, loader, steps=1000)                                # the loop, with progress and metrics

kiln compiles the whole training step (forward, backward, optimizer) into one optimized program
(C++ and CUDA) and runs it; tensors cross without copies (DLPack), and errors are kiln.Error.
"""
def _load_pytorch_nccl():
    """PyPI's torch links the NCCL of the nvidia-nccl wheel beside it, which may be newer than
    the CUDA toolkit's that kiln's module links (same soname): whichever loads first serves both,
    and torch fails to import over an older one. So that `import kiln` may come first, the
    wheel's library (when there is one) is loaded before the module; NCCL keeps its API across
    releases, so kiln runs on the newer one."""
    import ctypes
    import importlib.util
    import os
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return
    for folder in (spec.submodule_search_locations or []) if spec else []:
        library = os.path.join(folder, "lib", "libnccl.so.2")
        if os.path.exists(library):
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
            return


_load_pytorch_nccl()

from ._kiln import Error, version as __version__  # noqa: E402
from . import optim  # noqa: E402
from .optim import *  # noqa: E402,F401,F403  (kiln.Optimizer and one class per registry entry: kiln.AdamW, ...)
from .step import Step, compile, load  # noqa: E402
from .train import TrainResult, train  # noqa: E402

Error.__module__ = "kiln"

__all__ = ["Error", "Step", "TrainResult", "compile", "load", "train"] + [n for n in optim.__all__ if n != "from_torch"]
