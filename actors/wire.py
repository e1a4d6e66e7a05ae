"""How the step batches of spec/batch.py cross a Ray hop: all CPU tensors of one batch packed
into one byte buffer.

Ray pickles a torch tensor through torch's own reducer (a storage object, a rebuild call and
its arguments per tensor): a BatchMeta of 28 tensors took 1-2.5 ms to serialize and as much to
deserialize, four times per step (scheduler -> actor -> scheduler), which was most of the
actor graph's coordination. Here a batch travels as (its class's field layout, one bytes
blob): one copy in, one copy out, and the tensors read back own their memory (the channel's
shared buffer is reused by the next step, so nothing may point into it).

`register()` installs this for the classes in WIRE_TYPES in the calling process; the
receiving process needs nothing (the deserializer travels by reference). Tensors on other
devices (CUDA) and plain values travel as Ray would send them.
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial

import ray
import torch

from spec.batch import BatchMeta, DraftExtendInput, DraftInput, VerifyInput

WIRE_TYPES = (BatchMeta, DraftInput, VerifyInput, DraftExtendInput)
ALIGN = 8  # bytes: every tensor starts at a multiple of the widest element (long, float64)
_TENSOR = "t"  # layout tag of a packed tensor: (_TENSOR, dtype, shape, offset)


def pack(batch) -> tuple[tuple, bytes]:
    """(layout, blob): layout holds per field either (_TENSOR, dtype, shape, offset into blob)
    or the value itself (None, a plain value, a tensor not on the CPU)."""
    layout, chunks, offset = [], [], 0
    for f in fields(batch):
        value = getattr(batch, f.name)
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            layout.append(value)
            continue
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # (nbytes,)
        layout.append((_TENSOR, value.dtype, tuple(value.shape), offset))
        padded = -len(raw) % ALIGN
        chunks.append(raw + bytes(padded))
        offset += len(raw) + padded
    return tuple(layout), b"".join(chunks)


def unpack(cls, packed: tuple[tuple, bytes]):
    """The batch `pack` made, its tensors views of one fresh, writable buffer. Built as pickle
    builds a dataclass (no __init__ rerun): the fields hold exactly what was sent."""
    layout, blob = packed
    buffer = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    batch = cls.__new__(cls)
    for f, entry in zip(fields(cls), layout):
        if isinstance(entry, tuple) and len(entry) == 4 and entry[0] == _TENSOR:
            _, dtype, shape, offset = entry
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            entry = buffer[offset:offset + nbytes].view(dtype).reshape(shape)
        object.__setattr__(batch, f.name, entry)
    return batch


def register() -> None:
    """Send WIRE_TYPES packed from this process (Ray serializers are per process)."""
    for cls in WIRE_TYPES:
        # partial: pickled by reference (unpack, cls), not as a closure's code each time
        ray.util.register_serializer(cls, serializer=pack, deserializer=partial(unpack, cls))
