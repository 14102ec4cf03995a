"""Safetensors read and written with struct + json (so the PyTorch references need only torch):
the format kiln's checkpoints and the references' inputs and outputs use. F32 and I64 only."""
import json
import struct

import torch

DTYPES = {"F32": (torch.float32, 4), "I64": (torch.int64, 8)}


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        dtype, _ = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        flat = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype)
        tensors[name] = flat.reshape(info["shape"]).clone()
    return tensors, metadata


def save_safetensors(path, tensors, metadata):
    names = {torch.float32: "F32", torch.int64: "I64"}
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        raw = t.numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
