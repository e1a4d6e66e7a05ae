"""Shared checks for batches that cross a Ray hop (tests/test_wire.py, tests/test_step_stream.py)."""

from __future__ import annotations

import pickle
from dataclasses import fields

import torch
from ray import cloudpickle


def through_ray(obj):
    """What the other side of a Ray hop reads: Ray pickles with its CloudPickler."""
    return pickle.loads(cloudpickle.dumps(obj, protocol=5))


def assert_same(a, b) -> None:
    """Same class, and every field the same: None, plain value, or tensor of equal dtype, shape and values."""
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None:
            assert y is None, f.name
            continue
        if not isinstance(x, torch.Tensor):  # a plain value (a step's catch-up count and seconds)
            assert type(y) is type(x) and y == x, f.name
            continue
        assert (y.dtype, y.shape) == (x.dtype, x.shape), f.name
        assert torch.equal(x, y), f.name
