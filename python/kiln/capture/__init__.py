"""kiln.capture: a torch module to kiln's IR through torch.export (PyTorch >= 2.5), lowered in
Python through one table from ATen ops to kiln ops (aten.py); kiln.compile's path for modules
(docs/python.md). The C++ side never sees torch: it parses the IR text this writes."""
from .export import Captured, available, capture, supported_ops

__all__ = ["Captured", "available", "capture", "supported_ops"]
