"""kiln, a training compiler, from Python (docs/python.md).

    step = kiln.compile(model, (x, y), optimizer=kiln.AdamW(lr=1e-3))   # a torch module or an ONNX file
    loss = step(x, y)                                                    # one training step, the loss as a tensor
    kiln.train(model, loader, steps=1000)                                # the loop, with progress and metrics

kiln compiles the whole training step (forward, backward, optimizer) into one optimized program
(C++ and CUDA) and runs it; tensors cross without copies (DLPack), and errors are kiln.Error.
"""
from ._kiln import Error, version as __version__
from .optim import SGD, AdamW
from .step import Step, compile, load
from .train import TrainResult, train

Error.__module__ = "kiln"

__all__ = ["AdamW", "Error", "SGD", "Step", "TrainResult", "compile", "load", "train"]
