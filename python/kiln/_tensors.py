"""Tensors to and from kiln without copies: torch tensors and numpy arrays go to the extension
as they are (DLPack or the buffer protocol; it refuses what it cannot read in place), and kiln's
tensors come back as torch tensors or numpy arrays over kiln's bytes.

Bool tensors (attention and padding masks) cross as their bytes: torch 1.13's DLPack has no bool,
so a torch bool tensor goes as its u8 view, which the extension sees as bool again, and a kiln
bool tensor comes back as u8 bytes that torch views as bool (still no copy)."""
import sys

from . import _kiln


def torch_module():
    """torch if it is imported (kiln never imports it for numpy users)."""
    return sys.modules.get("torch")


def is_torch(x):
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def to_kiln(x, what):
    """`x` as the extension takes it: a torch tensor (detached: the same bytes) or an array."""
    if is_torch(x):
        x = x.detach()
        if x.dtype == torch_module().bool:
            return _kiln.view_as(x.view(torch_module().uint8), "bool", what, x)
        return x
    if hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__"):
        return x
    raise _kiln.Error(f"{what} is a {type(x).__name__}: kiln takes torch tensors and numpy arrays")


def from_kiln(array, framework):
    """A torch tensor ("torch") or a numpy array ("numpy") over the bytes of kiln's `array`."""
    if framework == "torch":
        torch = torch_module()
        if _kiln.dtype_of(array) == "bool":
            return torch.from_dlpack(_kiln.view_as(array, "u8", "a bool tensor", array)).view(torch.bool)
        return torch.from_dlpack(array)
    import numpy
    return numpy.asarray(array)


def framework_of(values, default):
    return "torch" if any(is_torch(v) for v in values) else default
