"""Prepacked linear layers for CPU inference (fp32 and bf16).

`F.linear` on bf16 CPU tensors hands oneDNN a plain row-major weight, which oneDNN reorders
into its blocked layout on every call: at decode sizes (1-8 rows) that reorder costs about as
much as the product itself. Reordering once at load time, with q/k/v and gate/up stacked into
one weight each (fewer, larger products), took SmolLM2-135M bf16 decode on an AVX512-BF16 2-core
CPU from 28.2 to 38.0 tokens/s at batch 1 and from 179 to 246 at batch 8, and an 8-token verify
from 38.5 to 28.5 ms (`python -m bench.runner --dtype bfloat16,float32`, run twice at the commits
before and after, back to back).

fp32 `F.linear` goes to MKL, whose products with 4-8 rows (a verify) cost nearly twice one row
and whose 49152-row LM head is slow even at one row. oneDNN's blocked fp32 product reads the
weights once for up to 8 rows: on an AVX2-only 2-core CPU (AMD EPYC) packing took fp32 decode
from 15.4 to 20.4 tokens/s at batch 1 and from 55 to 102 at batch 8, and a 4-token verify from
118 to 59 ms (1.85x -> 1.24x one token; the same command, back to back).

Where oneDNN has no bf16 product (an AVX2-only CPU: its bf16 reorder raises), a bf16 model's
linears are packed widened: the weights upcast to fp32 once at load (exact), each product's bf16
rows upcast on the way in and its fp32 sums rounded back to bf16 on the way out. That is the
arithmetic of a native bf16 product (bf16 operands, fp32 accumulation, a bf16 result), at fp32's
speed. Plain bf16 `F.linear` there converts as it multiplies, and its cost grows with the rows as
compute does: on the AVX2 EPYC, one layer's five products (SmolLM2's shapes and its LM head) took
5.4 / 29.6 / 67.7 / 130.5 ms at 1 / 8 / 16 / 32 rows, widened 7.3 / 11.5 / 17.0 / 25.1
(docs/benchmarks.md, session 42). At one row, where a product only reads its weights, the bf16
weights' half-size read wins, so a single row stays on plain `F.linear` over the linear's own bf16
weight: the widened layer holds both, three times bf16's weight memory (1.5x fp32's), for a batch-1
decode 1.7x as fast as widened alone (21.9 against 12.6 tokens/s, slices of each in turn on one
engine).

Only the runners pack their models: packed weights serve forward passes, not training or
`state_dict()`.

oneDNN builds (JIT-compiles) a product for each input shape and keeps it in two caches keyed by
shape, PyTorch's ideep LRU (`LRU_CACHE_CAPACITY`) and oneDNN's own primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1024 entries each by default and ~0.6 MB per entry for the
EAGLE-3 head's fp32 products. A server's row counts (batch x tree nodes, prompt lengths summed)
take ever new values, so the caches grew with every new row count: the draft actor's RSS rose
~25 MiB/min through a 5-minute soak (docs/benchmarks.md, `python -m bench.soak`). PackedLinear
therefore pads its rows to a few sizes (`padded_rows`): at most 16 + 4 per doubling, so the caches
stop growing once those are built. oneDNN's blocked product computes each row alike whatever the
row count above 16 (checked bitwise for fp32 and bf16), so padding changes no result.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import MLP, Attention


def _ops_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported"))


def product_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype | None:
    """The dtype a `dtype` model's packed products run in on `device`, None where it is not packed.
    CPU with oneDNN: fp32 as fp32; bf16 as bf16 where oneDNN runs it (AVX512 BW/VL/DQ, AVX-NE-CONVERT
    or AMX), else widened to fp32 (see the module's docstring). CUDA stays on cuBLAS."""
    if torch.device(device).type != "cpu" or not _ops_available():
        return None
    if dtype == torch.float32:
        return torch.float32
    if dtype == torch.bfloat16:
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    return None


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    return product_dtype(dtype, device) is not None


# Row counts up to this run unpadded: decode and verify sizes, where a product costs its weight
# reads and a padded row would not be free.
EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    """`rows` rounded up to one of 4 sizes per doubling above EXACT_ROWS (17-20 -> 20, 21-24 -> 24,
    ..., 33-40 -> 40): under 25% padding, and few distinct shapes for oneDNN to build and cache."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)  # a quarter of the power of two below rows
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout; x (..., in) -> (..., out) in x's dtype.
    `product_dtype`: the dtype the product runs in (default: the linear's own), x and y converted
    to and from it; where that widens the linear, a single row runs on its own weight instead (see
    the module's docstring)."""

    def __init__(self, linear: nn.Linear, product_dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product_dtype = product_dtype or linear.weight.dtype
        with torch.no_grad():
            # batch_size None: one layout for any number of rows (decode, verify and prefill).
            self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(self.product_dtype), None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(self.product_dtype)
        widened = self.product_dtype != linear.weight.dtype
        # (out, in) and (out,) in the linear's dtype: a tied LM head's is the embedding's own storage
        self.row_weight = linear.weight.detach() if widened else None
        self.row_bias = linear.bias.detach() if widened and linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (R, in)
        rows = flat.shape[0]
        if self.row_weight is not None and rows == 1:  # no guard on the rows where there is no row weight (compiled)
            return F.linear(x, self.row_weight, self.row_bias)
        flat = flat.to(self.product_dtype)
        # A compiled pass (models.compiled) runs its rows unpadded: at most MAX_ROWS of them, a bounded
        # set of shapes for oneDNN's caches, and no guard on the row count in its one graph.
        padded = rows if torch.compiler.is_compiling() else padded_rows(rows)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])  # (padded, in)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, "none", [], "")[:rows]
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"product_dtype={self.product_dtype}")


def pack_linears(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> int:
    """When `can_pack`: fuse q/k/v and gate/up projections, then swap every nn.Linear of
    `model` for a PackedLinear; returns how many were packed (0 when not packing).

    Call after the weights are loaded and moved: packed weights cannot be loaded or moved."""
    product = product_dtype(dtype, device)
    if product is None:
        return 0
    for module in model.modules():
        if isinstance(module, (Attention, MLP)):
            module.fuse_projections()
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, product))
    return len(targets)
