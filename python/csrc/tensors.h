// Tensors across the Python boundary through DLPack, without copies (docs/python.md): a torch
// tensor or numpy array becomes a kiln Tensor over the same bytes, and a kiln Tensor becomes a
// DLPack-capable object over its bytes (kiln/_tensors.py turns it into a torch tensor or a
// numpy array).
//
// Only what kiln can read in place crosses: a row-major contiguous tensor of a kiln dtype, on
// the CPU or a CUDA device. Anything else is a kiln::Error naming it; nothing is ever copied
// to make it fit, since a copy would silently lose what kiln writes (a param's in-place update).
#pragma once

#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "tensor/tensor.h"

namespace kiln::python {

// Any DLPack producer or buffer (torch, numpy, nanobind's own); no conversion is ever allowed.
using Array = nanobind::ndarray<>;

// A kiln Tensor over `array`'s bytes. It does not own them: the caller keeps the Python object
// alive while kiln may use the tensor (for a call, or as long as the Session that adopted it).
// `what` names the tensor in errors ("input 'x'", "param 'fc.weight'").
Tensor from_array(const Array& array, const std::string& what);

// A DLPack-capable Python object over `tensor`'s bytes, which it keeps alive; a CUDA tensor is
// on device `device_id`.
nanobind::object to_array(const Tensor& tensor, int device_id = 0);

// `array`'s bytes seen as `dtype`, of the same element size (bool <-> u8), a view that keeps
// `owner` (the Python object that owns the bytes) alive. Why: DLPack producers that have no bool
// (torch 1.13, numpy) pass a bool tensor as its u8 view, and kiln gives a bool tensor to them as
// u8; the bytes of a bool are 0 or 1 either way.
nanobind::object viewed_as(const Array& array, DType dtype, const std::string& what, nanobind::handle owner);

}  // namespace kiln::python
