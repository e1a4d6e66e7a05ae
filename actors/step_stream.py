"""A step's inputs across the scheduler -> runner-actor hop as deltas over what the actor holds.

Each step the scheduler sends a rank's actor (BatchMeta, DraftInput). Most of it is what the actor
already has: the sampling inputs of a batch whose requests did not change, the zero-width and
constant columns of a decode step, and the DraftInput the actor itself returned last step (it
comes back unchanged while no request joins or leaves). Each tensor costs a few Python calls to
pack and unpack (actors.wire), several times its warm price right after a forward, so a field the
actor holds travels as a reference instead: the persistent per-request state of vLLM V1's
`InputBatch`, kept by object identity rather than by a second copy of the scheduler's bookkeeping.

    sender = StreamSender()                 # scheduler side, one per rank and executor
    message = sender.encode(meta, draft_input)
    ... the actor: meta, draft_input = receiver.decode(message); ...; receiver.returned(draft_out)
    sender.returned(draft_out_as_received)  # after the step came back
    sender.reset()                          # after any failed step: the next message is whole

A field is held when it is the very tensor object the sender sent for that field last step, or
the one the actor returned for it (DraftInput fields). Nothing is compared by value, so holding
costs an `is` per field, and the actor gets back the exact tensor it had (runners never write
their inputs in place; the local engine passes them the same objects step after step too).
The receiver checks each message's stream and sequence number, so a message that does not follow
the one its holds refer to fails loudly instead of reading stale tensors; a new stream (a new
executor after recovery, or after `reset`) starts whole.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import fields

import torch

from spec.batch import BatchMeta, DraftInput

_PARTS = (BatchMeta, DraftInput)
_NAMES = tuple(tuple(f.name for f in fields(cls)) for cls in _PARTS)
# Held-field sources: the tensor sent for the field last step, or the one the actor returned for it.
SENT, RETURNED = 0, 1
_streams = itertools.count(int.from_bytes(os.urandom(6), "little") << 16)


class StreamError(RuntimeError):
    """A message that does not continue the stream its held fields refer to."""


def _without(batch, names: list[str]):
    """A shallow copy of `batch` with `names` set to None (they travel as references)."""
    copy = type(batch).__new__(type(batch))
    copy.__dict__.update(batch.__dict__)
    for name in names:
        setattr(copy, name, None)
    return copy


def _tensors(batch, part: int) -> dict[str, torch.Tensor]:
    """Field -> tensor of a batch of `_PARTS[part]` (None and plain fields left out)."""
    return {n: v for n in _NAMES[part] if isinstance(v := getattr(batch, n), torch.Tensor)}


def held_field(code: int) -> tuple[int, str, int]:
    """(part: 0 BatchMeta / 1 DraftInput, field name, source) of a held field's code (an int: pickled
    in a byte or two, where names and tuples cost tens)."""
    part = code >> 1 & 1
    return part, _NAMES[part][code >> 2], code & 1


class StreamSender:
    def __init__(self):
        self.holding = True  # False: every field whole (bench.graph's transport lever measures the difference)
        self.reset()

    def reset(self) -> None:
        """Forget what the actor holds: the next message is whole, on a new stream."""
        self.stream, self.seq = next(_streams), 0
        self.sent: list[dict[str, torch.Tensor]] = [{}, {}]  # per part: field -> tensor sent last step
        self.returned_by_actor: dict[str, torch.Tensor] = {}  # DraftInput field -> tensor the actor returned

    def encode(self, meta: BatchMeta, draft_input: DraftInput) -> tuple:
        """(stream, seq, held, meta, draft_input): held = (field code, ...) (`held_field`), those fields None."""
        held, parts = [], []
        for part, batch in enumerate((meta, draft_input)):
            sent, names = self.sent[part], []
            returned = self.returned_by_actor if part == 1 else {}
            now = self.sent[part] = _tensors(batch, part)
            for index, name in enumerate(_NAMES[part]):
                value = now.get(name)
                if value is None or not self.holding:
                    continue
                if value is sent.get(name):
                    held.append(index << 2 | part << 1 | SENT)
                    names.append(name)
                elif value is returned.get(name):
                    held.append(index << 2 | part << 1 | RETURNED)
                    names.append(name)
            parts.append(_without(batch, names) if names else batch)
        message = (self.stream, self.seq, tuple(held), *parts)
        self.seq += 1
        return message

    def returned(self, draft_input: DraftInput) -> None:
        """The DraftInput the step returned, as the scheduler received it."""
        self.returned_by_actor = _tensors(draft_input, 1)


class StreamReceiver:
    def __init__(self):
        self.stream, self.next_seq = None, 0
        self.held: list[dict[str, torch.Tensor]] = [{}, {}]
        self.returned_here: dict[str, torch.Tensor] = {}

    def decode(self, message) -> tuple[BatchMeta, DraftInput]:
        """The step's (meta, draft_input) with every held field filled in; a plain (meta, draft_input)
        (plain actor calls, the target-only executor) passes through and leaves the stream as it is."""
        if len(message) == 2:
            return message
        stream, seq, held, *parts = message
        if stream != self.stream:
            if seq != 0:
                raise StreamError(f"step message {seq} of a stream this actor never saw its start of")
            self.stream, self.next_seq, self.held, self.returned_here = stream, 0, [{}, {}], {}
        if seq != self.next_seq:
            raise StreamError(f"step message {seq} where {self.next_seq} was due")
        for part, name, source in map(held_field, held):
            value = (self.held[part] if source == SENT else self.returned_here).get(name)
            if value is None:
                raise StreamError(f"step message {seq} refers to a {_PARTS[part].__name__}.{name} this actor does not hold")
            setattr(parts[part], name, value)
        self.held = [_tensors(p, i) for i, p in enumerate(parts)]
        self.next_seq = seq + 1
        return parts[0], parts[1]

    def returned(self, draft_input: DraftInput) -> None:
        """The DraftInput this actor is about to return for the step it decoded last."""
        self.returned_here = _tensors(draft_input, 1)
