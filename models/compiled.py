"""A decoder's small passes compiled with torch.compile (inductor) on CPU.

A one-request bf16 decode step of the default model spends about a third of its time outside
the products: ~40 small ops a layer (RMSNorm's casts and reductions, RoPE, SiLU x up, residual
adds), each a separate pass over a few KB plus its dispatch. vLLM's CPU engine compiles its
model, and inductor fuses that elementwise work into a few loops. Here the same: the whole
decoder forward is one compiled graph, in which

- the packed linears stay oneDNN's blocked products (`mkldnn._linear_pointwise` calls, the
  weights packed at load as eager runs them: inductor's own lowering of that op wants the weight
  as a frozen graph constant, so it is swapped for a plain call to the op, see `_allow_packed_linears`);
- attention stays `models.attention.paged_attention`, one opaque op (its path depends on the
  batch's shape, and it writes the KV pool in place);
- inductor fuses everything between them.

Only passes of at most `MAX_ROWS` token rows run compiled (decode of up to 64 requests, verify
trees of a few): one graph with a symbolic row count serves them all (sizes of one are not
specialised, see `_DYNAMIC`), its linears on their rows unpadded, a bounded set of shapes for
oneDNN's caches (`models.packed`). Longer passes (prefill, larger batches) run eagerly, as do
passes attending in parts or prefilling from scratch.

Whole decode steps of the default model, eager and compiled taking turns on one runner (AMD Zen 5,
avx512_bf16 without AMX, 2 threads, 60-token prompts; docs/benchmarks.md "Session 47"): compiled
0.87x / 0.92x / 0.90x / 0.91x the eager step at 1 / 4 / 16 / 32 requests in bf16, 0.90x / 0.88x /
0.91x / 0.94x in fp32; a one-request verify of 8 / 16 tokens 1.01x / 0.96x in bf16, 0.87x / 0.83x
in fp32.

Compiling takes tens of seconds (inductor's C++ build; its FX graph cache keeps the result for
the next start), so `warm_up` compiles at load, not at a user's first request.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
import torch.fx.experimental._config as fx_config

from models.attention import AttentionMetadata, KVPool
from models.packed import product_dtype

MAX_ROWS = 64  # token rows of the largest compiled pass
# One graph for every row count up to MAX_ROWS and every metadata shape: no specialisation of
# sizes 0 / 1 (a batch of one, one query a request) and no equalities guessed between sizes that
# happen to match (duck shapes); both would compile a new graph per batch shape.
_DYNAMIC = dict(backed_size_oblivious=True, use_duck_shape=False)


def compiles(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a `dtype` model on `device` runs its small passes compiled: on CPU, where its linears
    are packed in their own dtype. (A bf16 model widened to fp32 products, on a CPU without native
    bf16, runs a single row on its own weight, a choice that would split the graph by row count; on
    CUDA the small passes replay CUDA graphs instead.)"""
    return torch.device(device).type == "cpu" and product_dtype(dtype, device) == dtype


@functools.cache
def _allow_packed_linears() -> None:
    """Let inductor call oneDNN's packed products as they are (once per process).

    Inductor lowers `mkldnn._linear_pointwise` only with the weight a frozen graph constant (its
    own weight packing, under `freezing`, which compiled the whole model for 17 minutes here,
    docs/benchmarks.md), and its post-grad patterns fuse a following add into the op's `binary`
    form, which has no fake (shape) function. Our weights are packed already: both forms become
    fallbacks, plain calls of the op, and `binary` gets its shape function."""
    from torch._inductor import lowering

    @torch.library.register_fake("mkldnn::_linear_pointwise.binary")
    def _(x, other, weight, bias, attr):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))  # (..., out)

    for op in (torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary):
        lowering.lowerings.pop(op, None)
        lowering.make_fallback(op, warn=False)


class CompiledDecoder:
    """A LlamaForCausalLM's forward, compiled for passes of at most MAX_ROWS rows on CPU.

    Compiled once, by `warm_up`, into one graph with symbolic sizes; every pass `takes` then runs the
    code Dynamo made of `forward` directly, without Dynamo's per-call cache lookup and guard checks
    (~1-2 ms a step over this model's ~300 parameters and 60 KV tensors: against the guarded call,
    0.83-0.86x the eager step instead of 0.88-0.92x at 1-16 requests, bf16, AMD Zen 5; vLLM's
    compiled models dispatch the same way). The guards it skips hold by construction: one
    model and pool, one `aux_layer_ids`, and `takes` admits only passes of the compiled kind."""

    def __init__(self, model: torch.nn.Module):
        _allow_packed_linears()
        self.model = model
        self._run: Callable | None = None  # forward's compiled code, as a function
        self.aux_layer_ids: list[int] | None = None  # the layers whose inputs the graph returns too

    @staticmethod
    def takes(tokens: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a pass runs compiled: few rows, attention gathered in one piece."""
        return tokens.shape[0] <= MAX_ROWS and meta.parts is None and meta.fresh_lens is None

    def warm_up(self, kv: KVPool, aux_layer_ids: list[int] | None, dump_slot: int) -> None:
        """Compile: one request verifying two tokens, written to the dump slot (which no request
        owns) and attending to it only. Sizes stay symbolic (`_DYNAMIC`), so the graph serves any
        pass `takes`, a single row included."""
        forward = type(self.model).forward
        # A code object of this decoder's own: Dynamo keeps its compiled versions per code object, and
        # a second decoder of the same class (another runner in the process) would otherwise reuse the
        # first one's without compiling, leaving nothing to capture.
        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__)
        codes: list[types.CodeType] = []
        hook = torch._dynamo.convert_frame.register_bytecode_hook(
            lambda old, new: codes.append(new) if old is own.__code__ else None)
        try:
            compiled = functools.partial(torch.compile(own, dynamic=True, fullgraph=True), self.model)
            dump = torch.tensor([dump_slot, dump_slot])
            meta = AttentionMetadata.build([dump[:1]], [dump], torch.arange(1, 3), [None])
            # Under inference_mode, as the runners' passes run: a graph traced with autograd on keeps
            # tensors for a backward pass, which inference tensors refuse.
            with fx_config.patch(**_DYNAMIC), torch.inference_mode():
                compiled(torch.zeros(2, dtype=torch.long), meta, kv, aux_layer_ids)
        finally:
            hook.remove()
        if len(codes) != 1:
            raise RuntimeError(f"torch.compile made {len(codes)} versions of the decoder's forward, expected one")
        self._run = types.FunctionType(codes[0], forward.__globals__, forward.__name__)
        self.aux_layer_ids = aux_layer_ids

    def __call__(self, tokens: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> tuple:
        """forward(tokens, meta, kv, aux_layer_ids) of a pass `takes`, through the compiled code."""
        return self._run(self.model, tokens, meta, kv, self.aux_layer_ids)
