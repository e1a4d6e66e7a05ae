"""How the step batches of spec/batch.py cross a Ray hop: all CPU tensors of one batch packed
into one byte buffer.

Ray pickles a torch tensor through torch's own reducer (a storage object, a rebuild call and
its arguments per tensor): a BatchMeta of 28 tensors took 1-2.5 ms to serialize and as much to
deserialize, four times per step (scheduler -> actor -> scheduler), which was most of the
actor graph's coordination. Here a batch travels as (its class's field layout, one bytes
blob): one copy in, one copy out, and the tensors read back own their memory (the channel's
shared buffer is reused by the next step, so nothing may point into it). The same
packing serves our own channel's pickles (`dumps`, actors.shm_channel). The tensors are
joined by one numpy call and split back by one torch call per dtype: a step's four batches (~45
tensors) pack and unpack in about half the time of a few torch calls per tensor
(docs/benchmarks.md, session 31).

`register()` installs this for the classes in WIRE_TYPES in the calling process; the
receiving process needs nothing (the deserializer travels by reference). Tensors on other
devices (CUDA) and plain values travel as Ray would send them.
"""

from __future__ import annotations

import copyreg
import io
import math
import pickle
from dataclasses import fields
from functools import partial

import numpy as np
import ray
import torch

from spec.batch import BatchMeta, DraftExtendInput, DraftInput, VerifyInput

WIRE_TYPES = (BatchMeta, DraftInput, VerifyInput, DraftExtendInput)
# Tensor dtypes that travel packed, widest element first: the blob holds one run per dtype in this
# order, so every run starts aligned for its element (each run's length is a multiple of its own).
PACKED_DTYPES = (torch.float64, torch.int64, torch.float32, torch.int32, torch.bfloat16, torch.float16,
                 torch.int16, torch.uint8, torch.int8, torch.bool)
_CODES = {dtype: code for code, dtype in enumerate(PACKED_DTYPES)}
_NUMPY_VIEW = {_CODES[torch.bfloat16]: torch.int16}
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def pack(batch) -> tuple[tuple, bytes]:
    """((specs, others), blob). Per field, `specs` holds (dtype code, *shape) of a packed tensor or
    None for a value sent as it is (None, a plain value, a tensor not on the CPU, a dtype not in
    PACKED_DTYPES), in `others`. The tensors, grouped by dtype, are copied into the blob by one numpy
    call, so a batch costs a few Python calls per tensor and no torch op (each costs several times its
    warm price in a process whose caches the forward just swept, and a torch op over more than 32k
    elements starts an OpenMP team on Ray's thread, a second team in the actor that makes libgomp stop
    spinning in every region of the forward); the layout is ints and tuples, which the pickler writes
    without a Python callback (a torch.dtype takes one)."""
    specs, others, groups = [], [], {}
    for name in _field_names(type(batch)):
        value = getattr(batch, name)
        code = _CODES.get(value.dtype) if isinstance(value, torch.Tensor) and value.is_cpu else None
        if code is None:
            specs.append(None)
            others.append(value)
            continue
        specs.append((code, *value.shape))
        group = groups.get(code)
        if group is None:
            groups[code] = [value]
        else:
            group.append(value)
    arrays = []  # (nbytes,) uint8 views, dtype groups in code order
    for code in sorted(groups):
        reinterpret = _NUMPY_VIEW.get(code)  # numpy has no bfloat16: its bits travel as int16
        for value in groups[code]:
            array = (value.view(reinterpret) if reinterpret is not None else value).detach().numpy()
            arrays.append(array.reshape(-1).view(np.uint8))  # reshape copies a strided tensor
    return (tuple(specs), tuple(others)), np.concatenate(arrays).tobytes() if arrays else b""


def unpack(cls, packed: tuple[tuple, bytes]):
    """The batch `pack` made, its tensors views of one fresh, writable buffer. Built as pickle
    builds a dataclass (no __init__ rerun): the fields hold exactly what was sent."""
    (specs, others), blob = packed
    sizes: dict[int, list[int]] = {}  # dtype code -> numel of each of its tensors, in field order
    for spec in specs:
        if spec is not None:
            sizes.setdefault(spec[0], []).append(math.prod(spec[1:]))
    buffer = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else None
    pieces, offset = {}, 0
    for code in sorted(sizes):
        dtype = PACKED_DTYPES[code]
        nbytes = sum(sizes[code]) * dtype.itemsize
        run = buffer[offset:offset + nbytes].view(dtype) if nbytes else torch.empty(0, dtype=dtype)
        offset += nbytes
        pieces[code] = iter(run.split_with_sizes(sizes[code]))  # 1-D views, one call
    rest, values = iter(others), []
    for spec in specs:
        if spec is None:
            values.append(next(rest))
        else:
            piece = next(pieces[spec[0]])
            values.append(piece if len(spec) == 2 else piece.view(spec[1:]))  # a 1-D tensor is its piece
    batch = cls.__new__(cls)
    batch.__dict__.update(zip(_field_names(cls), values))
    return batch


def _reduce(batch):
    return unpack, (type(batch), pack(batch))


# The pickler's table for our own channel (actors.shm_channel): WIRE_TYPES go packed, as through Ray.
_DISPATCH = {**copyreg.dispatch_table, **{cls: _reduce for cls in WIRE_TYPES}}


def dumps(value) -> bytes:
    """`value` pickled (protocol 5) with every WIRE_TYPES batch in it packed; `pickle.loads` reads it."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(value)
    return out.getvalue()


def register() -> None:
    """Send WIRE_TYPES packed from this process (Ray serializers are per process)."""
    for cls in WIRE_TYPES:
        # partial: pickled by reference (unpack, cls), not as a closure's code each time
        ray.util.register_serializer(cls, serializer=pack, deserializer=partial(unpack, cls))
