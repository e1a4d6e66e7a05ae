"""CUDA graphs for a runner's small passes: the target's decode/verify, the draft's propose
levels and extends.

On a GPU a decode step's host work (hundreds of kernel launches) outlasts its GPU work. A pass
whose requests each carry a few new tokens is replayed from a graph captured for its shape:
`batch` requests (the next bucket of BATCH_BUCKETS, the missing ones idle) x `nodes` new tokens
each (a request with fewer gets trailing padding tokens) x a key width (the next power of two
from MIN_KEYS). Padding never touches a real row: idle requests and padding tokens write their
K/V to a dump slot that the slot allocator never hands out (the pool's last, see
`pool_slots`), attend only to themselves, and their outputs are dropped; real queries see only
their own keys (the causal or tree mask). Prefill chunks (more than MAX_NODES tokens), batches
above the largest bucket and every pass off CUDA run eagerly.

`StepGraphs.run` on CPU, or with capture off, runs the same padded static-buffer pass eagerly:
the tests check there that padding leaves the real rows' outputs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.pass_rows import PassRows
from models.attention import AttentionMetadata

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_NODES = 64  # more new tokens in a request (a prompt chunk): eager
MIN_KEYS = 256


def pool_slots(num_slots: int) -> int:
    """KV pool size for `num_slots` allocatable slots: one more, the dump slot (`num_slots`)."""
    return num_slots + 1


def batch_bucket(requests: int) -> int | None:
    """The smallest bucket holding `requests`, or None above the largest (eager)."""
    return next((b for b in BATCH_BUCKETS if b >= requests), None)


def key_bucket(keys: int) -> int:
    """Key columns of a graph for passes whose longest request attends to `keys` keys."""
    width = MIN_KEYS
    while width < keys:
        width *= 2
    return width


@dataclass(frozen=True)
class GraphKey:
    batch: int
    nodes: int
    keys: int
    trees: bool  # tree masks (verify) or causal (draft levels, extends)


def plan(rows: PassRows) -> GraphKey | None:
    """The graph shape that holds `rows`, or None where the pass runs eagerly (a prompt chunk,
    a mixed step, more requests than the largest bucket)."""
    if rows.num_requests == 0:
        return None
    batch = batch_bucket(rows.num_requests)
    nodes = int(rows.new_lens.max())
    if batch is None or nodes > MAX_NODES or int(rows.new_lens.min()) < 1:
        return None
    if rows.trees is None and not bool(rows.prefix_lens.any()):
        return None  # a prefill from scratch (its attention needs no keys gathered)
    trees = rows.trees is not None
    if trees and (int(rows.trees.shape[0]) != rows.num_requests or bool((rows.new_lens != nodes).any())):
        return None  # trees for some requests only: a mixed step
    return GraphKey(batch, nodes, key_bucket(int((rows.prefix_lens + rows.new_lens).max())), trees)


def pad_rows(rows: PassRows, key: GraphKey, dump_slot: int) -> tuple[PassRows, torch.Tensor]:
    """`rows` as key.batch requests of key.nodes new tokens: each request's tokens padded at its
    end, then idle requests (no prefix). Every padding token is at position 0 in the dump slot.
    -> (padded rows, (T,) padded row of each real token)."""
    reqs, nodes, extra = rows.num_requests, key.nodes, key.batch - rows.num_requests
    valid = torch.arange(nodes) < rows.new_lens.unsqueeze(1)  # (R, nodes)
    real = (torch.arange(reqs).unsqueeze(1) * nodes + torch.arange(nodes))[valid]  # (T,)
    padded = PassRows(
        tokens=spread(rows.tokens, real, key.batch * nodes, 0),
        positions=spread(rows.positions, real, key.batch * nodes, 0),
        prefix=F.pad(rows.prefix, (0, 0, 0, extra)),
        prefix_lens=F.pad(rows.prefix_lens, (0, extra)),
        slots=spread(rows.slots, real, key.batch * nodes, dump_slot),
        new_lens=torch.full((key.batch,), nodes, dtype=torch.long),
        trees=None if rows.trees is None else torch.cat(
            [rows.trees.bool(), torch.ones(nodes, nodes, dtype=torch.bool).tril().expand(extra, nodes, nodes)]),
    )
    return padded, real


def spread(x: torch.Tensor, rows: torch.Tensor, total: int, fill) -> torch.Tensor:
    """x (T, ...) placed at `rows` of a (total, ...) tensor filled with `fill`."""
    out = x.new_full((total, *x.shape[1:]), fill)
    out[rows] = x
    return out


# forward(tokens (T,), hidden (T, Hin) or None, metadata) -> tuple of (T, ...) tensors or None
Forward = Callable[[torch.Tensor, torch.Tensor | None, AttentionMetadata], tuple]


class _Graph:
    """One shape's static inputs, metadata and outputs, and its captured graph (None: eager)."""

    def __init__(self, key: GraphKey, device, hidden: torch.Tensor | None):
        tokens, cols = key.batch * key.nodes, key.keys
        long = lambda *s: torch.zeros(s, dtype=torch.long, device=device)  # noqa: E731
        self.tokens = long(tokens)
        self.hidden = None if hidden is None else hidden.new_zeros((tokens, hidden.shape[1]), device=device)
        self.meta = AttentionMetadata(
            positions=long(tokens), out_slots=long(tokens), kv_index=long(key.batch, cols),
            mask=torch.zeros((key.batch, 1, key.nodes, cols), dtype=torch.bool, device=device),
            q_index=long(key.batch, key.nodes), out_rows=long(tokens), padded=False)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple | None = None

    def load(self, rows: PassRows, hidden: torch.Tensor | None, key: GraphKey) -> None:
        """Copy one step's padded rows into the static buffers (in place: the graph reads them)."""
        meta = rows.metadata(self.tokens.device, kv_width=key.keys)
        self.tokens.copy_(rows.tokens)
        if self.hidden is not None:
            self.hidden.copy_(hidden)
        for name in ("positions", "out_slots", "kv_index", "mask", "q_index", "out_rows"):
            getattr(self.meta, name).copy_(getattr(meta, name))


class StepGraphs:
    """Runs a runner's small passes through per-shape static buffers, captured as CUDA graphs
    (lazily, at a shape's first pass) when `capture`; eagerly otherwise (CPU, tests)."""

    def __init__(self, forward: Forward, device, dump_slot: int, capture: bool):
        self.forward, self.device, self.dump_slot = forward, torch.device(device), dump_slot
        self.capture = capture and self.device.type == "cuda"
        self._graphs: dict[tuple[GraphKey, bool], _Graph] = {}
        self._pool = None  # one memory pool shared by every captured graph
        self.replays = 0  # passes run through static buffers (a count the tests read)

    def run(self, rows: PassRows, hidden: torch.Tensor | None = None) -> tuple | None:
        """The forward's outputs for `rows` (their real rows only, fresh tensors), or None when the
        pass has no graph shape (`plan`): the caller then runs it eagerly."""
        key = plan(rows)
        if key is None:
            return None
        padded, real = pad_rows(rows, key, self.dump_slot)
        hidden = None if hidden is None else spread(hidden.to(self.device), real.to(self.device), padded.num_tokens, 0)
        slot = (key, hidden is not None)
        graph = self._graphs.get(slot)
        if graph is None:
            graph = self._graphs[slot] = _Graph(key, self.device, hidden)
        graph.load(padded, hidden, key)
        if not self.capture:
            outputs = self.forward(graph.tokens, graph.hidden, graph.meta)
        else:
            if graph.graph is None:
                self._capture(graph)
            graph.graph.replay()
            outputs = graph.outputs
        self.replays += 1
        index = real.to(self.device)
        return tuple(None if out is None else out.index_select(0, index) for out in outputs)

    def _capture(self, graph: _Graph) -> None:
        """Warm up on a side stream (allocator, kernel choice), then capture one pass. The static
        buffers hold this step's inputs, so warm-up and capture rewrite the same K/V."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(graph.tokens, graph.hidden, graph.meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph.graph, pool=self._pool):
            graph.outputs = self.forward(graph.tokens, graph.hidden, graph.meta)
        self._pool = graph.graph.pool()
