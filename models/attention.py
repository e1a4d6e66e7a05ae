"""Ragged attention over a token-slot KV pool.

Each layer owns one K and one V tensor of shape (kv_heads, num_slots, head_dim); the
scheduler hands out slot ids. A forward pass carries, per request, the slots of its
committed context (prefix) and of its new tokens, plus a mask among the new tokens
(causal for prefill, a tree mask for verify). Linear layers run on the flat (T, H) token
rows; only attention pads requests to (B, Q, K), with one metadata object shared by every
layer of the pass.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils.rnn import pad_sequence


@dataclass
class AttentionMetadata:
    """Index tensors for one forward pass, built once and shared by every layer.

    positions: (T,)        absolute position of each new token (RoPE)
    out_slots: (T,)        slot each new token's K/V is written to
    kv_index:  (B, K)      slots each request attends to (prefix then new), padded with 0
    mask:      (B, 1, Q, K) bool, True where query q of request b may attend key k
    q_index:   (B, Q)      flat row of each padded query (padding points at row T, a zero row)
    out_rows:  (T,)        row of each token in the flattened (B * Q) padded queries
    padded:    False when every request has Q new tokens (T = B * Q): queries are then plain views
    fresh_lens: new-token counts per request when no request has a prefix and every mask is
               causal (a prefill from scratch), else None: attention then needs no gather or mask
    """

    positions: torch.Tensor
    out_slots: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor
    q_index: torch.Tensor
    out_rows: torch.Tensor
    padded: bool
    fresh_lens: list[int] | None = None
    # A mixed step (decode/verify rows of a few queries, prefill chunks of hundreds) attends in
    # parts: padding every request to the longest chunk would cost the decode rows (Q_max / n)
    # times their scores. (start row, end row, metadata of those consecutive requests), or None.
    parts: list[tuple[int, int, "AttentionMetadata"]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls,
        prefix_slots: list[torch.Tensor],
        new_slots: list[torch.Tensor],
        positions: torch.Tensor,
        new_masks: list[torch.Tensor | None],
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """`batched` from per-request lists (tools and tests; the runners build `batched`'s
        tensors directly): prefix_slots[b] (P_b,) committed slots; new_slots[b] (n_b,) slots of its
        new tokens (flat order = requests in order); new_masks[b] (n_b, n_b) bool, or None for
        causal."""
        lead = next((b for b, m in enumerate(new_masks) if m is None), len(new_masks))
        trees = [m.bool() for m in new_masks[:lead]]
        if any(m is not None for m in new_masks[lead:]) or len({m.shape for m in trees}) > 1:
            # Masks anywhere: every request gets one, causal ones as a lower triangle, all padded to
            # the largest (the columns past a request's own tokens stay masked).
            size = max(int(s.numel()) for s in new_slots)
            trees = [F.pad(torch.ones(n, n, dtype=torch.bool).tril() if m is None else m.bool(),
                           (0, size - n, 0, size - n)) for m, n in ((m, int(s.numel())) for m, s in zip(new_masks, new_slots))]
        return cls.batched(
            pad_sequence([p.long() for p in prefix_slots], batch_first=True) if prefix_slots
            else torch.zeros((0, 0), dtype=torch.long),
            torch.tensor([int(p.numel()) for p in prefix_slots], dtype=torch.long),
            torch.cat(new_slots) if new_slots else torch.zeros(0, dtype=torch.long),
            torch.tensor([int(s.numel()) for s in new_slots], dtype=torch.long),
            positions, torch.stack(trees) if trees else None, device,
        )

    @classmethod
    def batched(
        cls,
        prefix_slots: torch.Tensor,
        prefix_lens: torch.Tensor,
        new_slots: torch.Tensor,
        new_lens: torch.Tensor,
        positions: torch.Tensor,
        tree_masks: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        kv_width: int = 0,
    ) -> "AttentionMetadata":
        """One step's metadata from flat tensors, with a fixed number of tensor ops on `device`
        whatever the batch (no per-request Python):

        prefix_slots (B, L) each request's committed slots, valid up to prefix_lens (B,);
        new_slots (T,) the new tokens' slots, request after request, new_lens (B,) of them each;
        positions (T,); tree_masks (Bt, N, N) bool: the masks of the first Bt requests, which have
        N new tokens each (a verify step's trees, the decode rows of a mixed step), or None: causal.
        kv_width: at least this many key columns (a CUDA graph's fixed K; the extra ones masked)."""
        prefix_lens, new_lens = prefix_lens.long().cpu(), new_lens.long().cpu()
        batch, trees = int(new_lens.shape[0]), 0 if tree_masks is None else int(tree_masks.shape[0])
        fresh = trees == 0 and not bool(prefix_lens.any())  # unpadded already
        runs = [] if fresh else _query_runs(new_lens, trees)
        if len(runs) > 1:
            return cls._in_parts(runs, prefix_slots, prefix_lens, new_slots, new_lens, positions, tree_masks, device)
        out_slots, positions = new_slots.long().to(device), positions.to(device)
        if fresh:  # attention splits the rows by request and needs no gather or mask
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return cls(positions=positions, out_slots=out_slots, kv_index=empty.view(batch, 0),
                       mask=empty.bool().view(batch, 1, 0, 0), q_index=empty.view(batch, 0), out_rows=empty,
                       padded=False, fresh_lens=new_lens.tolist())
        max_q = int(new_lens.max()) if batch else 0
        max_k = max(int((prefix_lens + new_lens).max()) if batch else 0, kv_width,
                    int((prefix_lens[:trees] + tree_masks.shape[1]).max()) if trees else 0)
        total = int(new_lens.sum())
        lens_p, lens_n = prefix_lens.to(device).unsqueeze(1), new_lens.to(device).unsqueeze(1)  # (B, 1)
        starts = lens_n.cumsum(0) - lens_n  # (B, 1) first flat row of each request
        q_pos, k_pos = torch.arange(max_q, device=device), torch.arange(max_k, device=device)
        # Each request's keys: its prefix then its new slots, zero-padded to K.
        prefix_slots = prefix_slots.long().to(device)
        if prefix_slots.shape[1] == 0:
            prefix_slots = prefix_slots.new_zeros((batch, 1))
        from_prefix = prefix_slots.gather(1, k_pos.clamp(max=prefix_slots.shape[1] - 1).expand(batch, max_k))
        new_row = (starts + k_pos - lens_p).clamp(0, total)  # (B, K) flat row of key k if new
        from_new = torch.cat([out_slots, out_slots.new_zeros(1)])[new_row]
        kv_index = torch.where(k_pos < lens_p, from_prefix, torch.where(k_pos < lens_p + lens_n, from_new, 0))
        valid_q = q_pos < lens_n  # (B, Q)
        # Causal: query q of request b sees keys up to P_b + q (its whole prefix included).
        mask = (k_pos <= (lens_p + q_pos).unsqueeze(2)) & valid_q.unsqueeze(2)  # (B, Q, K)
        if trees:
            # Tree rows' new-token block (columns P_b .. P_b + N) is their own mask instead.
            n = int(tree_masks.shape[1])
            cols = (lens_p[:trees] + torch.arange(n, device=device)).unsqueeze(1).expand(trees, n, n)  # (Bt, N, N)
            mask[:trees, :n].scatter_(2, cols, tree_masks.to(device).bool())
        q_index = torch.where(valid_q, starts + q_pos, total)
        # Padded query rows attend to one key so softmax stays finite; their output is dropped.
        mask[..., 0] |= ~valid_q
        padded = total != batch * max_q
        return cls(
            positions=positions,
            out_slots=out_slots,
            kv_index=kv_index,
            mask=mask.unsqueeze(1),
            q_index=q_index,
            out_rows=valid_q.flatten().nonzero().flatten() if padded else q_index.flatten(),
            padded=padded,
        )

    @classmethod
    def _in_parts(cls, runs: list[tuple[int, int]], prefix_slots, prefix_lens, new_slots, new_lens, positions,
                  tree_masks, device) -> "AttentionMetadata":
        """One part per run of consecutive requests (see `_query_runs`); the K/V of every new
        token is still written at once, through the whole pass's out_slots."""
        rows = [0] + new_lens.cumsum(0).tolist()
        trees = 0 if tree_masks is None else int(tree_masks.shape[0])
        parts = [(rows[a], rows[b], cls.batched(
            prefix_slots[a:b], prefix_lens[a:b], new_slots[rows[a]:rows[b]], new_lens[a:b],
            positions[rows[a]:rows[b]], tree_masks[a:b] if a < trees else None, device)) for a, b in runs]
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return cls(positions=positions.to(device), out_slots=new_slots.long().to(device), kv_index=empty,
                   mask=empty.bool(), q_index=empty, out_rows=empty, padded=False, parts=parts)


# Prompt chunks with more new tokens than this attend apart from shorter ones.
LONG_QUERIES = 16


def _query_runs(new_lens: torch.Tensor, trees: int = 0) -> list[tuple[int, int]]:
    """(start, end) request ranges of consecutive requests alike: the first `trees` (verify trees),
    one-token rows (plain decode), chunks of at most LONG_QUERIES tokens, longer chunks. One range for
    an ordinary decode or prefill step, two for a mixed step (its decode rows first, then its prompt
    chunks): each range pads its queries to its longest, and a short prompt riding in a plain decode
    step of 31 requests padded every decode row to its length (a 12-token prompt cost the step 49 ms,
    24 apart, fp32; docs/benchmarks.md, session 20)."""
    kinds = [0 if i < trees else 1 if n == 1 else 2 if n <= LONG_QUERIES else 3 for i, n in enumerate(new_lens.tolist())]
    cuts = [i for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1]]
    bounds = [0, *cuts, len(kinds)]
    return list(zip(bounds[:-1], bounds[1:]))


class KVPool:
    """Per-layer K/V tensors indexed by slot ids: (kv_heads, num_slots, head_dim) each.

    Head-major, so that a request's keys for one KV head are rows of one (Hkv * S, D) table and a
    single index_select gathers the batch as (B, Hkv, K, D) with each (K, D) matrix contiguous, where a
    slot-major pool's gather had to be copied once more into such a layout in every layer (the largest
    of the small ops of a batch-16 decode step in a CPU profile)."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (kv_heads, num_slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, kernel: bool = False,
) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens, caches (Hkv, S, D) -> (T, Hq, D).

    Writes the new K/V into their slots, then attends over each request's gathered slots; `kernel`:
    a pass attending in one piece goes through our C++ CPU operator (models.cpu_kernels), which does
    both in its own loops for up to 16 queries a request (decode, verify) and comes back here for more.
    """
    if meta.parts is None and meta.fresh_lens is None and (kernel or torch.compiler.is_compiling()):
        # One opaque op: our C++ operator, or inside a compiled forward (models.compiled) this eager
        # code as an operator (its path depends on the batch's shape, and the cache writes mutate the
        # pool in place).
        op = torch.ops.specgraph_kernels.paged_attention if kernel else torch.ops.specgraph.paged_attention
        return op(q, k, v, k_cache, v_cache, meta.out_slots, meta.kv_index, meta.mask, meta.q_index, meta.out_rows,
                  scale)
    k_cache.index_copy_(1, meta.out_slots, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.out_slots, v.transpose(0, 1))
    return _attend(q, k, v, k_cache, v_cache, meta, scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """paged_attention once the new K/V are in the cache: q (T, Hq, D) -> (T, Hq, D)."""
    if meta.parts is not None:
        return torch.cat([_attend(q[a:b], k[a:b], v[a:b], k_cache, v_cache, part, scale) for a, b, part in meta.parts])
    if meta.fresh_lens is not None:
        return fresh_causal_attention(q, k, v, meta.fresh_lens, scale)
    num_tokens, heads, dim = q.shape
    batch, num_q = meta.q_index.shape
    # index_select on flat indices: several times faster than advanced indexing at decode sizes.
    if meta.padded:
        q_pad = torch.cat([q, q.new_zeros(1, heads, dim)]).index_select(0, meta.q_index.flatten())
    else:
        q_pad = q
    q_pad = q_pad.view(batch, num_q, heads, dim)  # (B, Q, Hq, D)
    # The pool's rows as one (Hkv * S, D) table: index_select along dim 0 splits its rows over the
    # threads, along dim 1 of (Hkv, S, D) it ran on one (bf16, 2 threads, 32 x 120 keys: 30 vs 89 us).
    # Gathered request-major, (B, Hkv, K, D) contiguous: SDPA reads it as fast as the head-major
    # order's views, and `grouped_attention`'s batched products need it (a strided batch cost them 2x).
    kv_heads = k_cache.shape[0]
    rows = (meta.kv_index.view(batch, 1, -1) + _head_starts(kv_heads, k_cache.shape[1], q.device)).view(-1)  # (B * Hkv * K,)
    keys = k_cache.view(-1, dim).index_select(0, rows).view(batch, kv_heads, -1, dim)  # (B, Hkv, K, D)
    values = v_cache.view(-1, dim).index_select(0, rows).view(batch, kv_heads, -1, dim)
    out = masked_attention(q_pad.transpose(1, 2), keys, values, meta.mask, scale,
                           expand_kv=q.is_cuda).transpose(1, 2)  # (B, Q, Hq, D)
    out = out.reshape(batch * num_q, heads, dim)
    return out.index_select(0, meta.out_rows) if meta.padded else out  # (T, Hq, D)


# paged_attention as one operator for compiled graphs (models.compiled), registered on the CPU
# dispatch key directly: a `torch.library.custom_op` call costs ~10 us more (its Python wrapper), 30
# times a step. `padded` is not an argument but read from the shapes (total rows against padded
# queries), so that a compiled graph holds no constant that differs between passes.
_LIBRARY = torch.library.Library("specgraph", "FRAGMENT")
_LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                "Tensor out_slots, Tensor kv_index, Tensor mask, Tensor q_index, Tensor out_rows, float scale) -> Tensor")


def _paged_attention_op(q, k, v, k_cache, v_cache, out_slots, kv_index, mask, q_index, out_rows, scale):
    meta = AttentionMetadata(positions=out_slots, out_slots=out_slots, kv_index=kv_index, mask=mask,
                             q_index=q_index, out_rows=out_rows, padded=out_rows.numel() != q_index.numel())
    # Contiguous, as the fake below promises: the compiled graph reads the output with those strides,
    # and a path's output may be a transposed view (grouped attention's over one request's queries).
    return paged_attention(q, k, v, k_cache, v_cache, meta, scale).contiguous()


_LIBRARY.impl("paged_attention", _paged_attention_op, "CPU")


@torch.library.register_fake("specgraph::paged_attention", lib=_LIBRARY)
def _(q, k, v, k_cache, v_cache, out_slots, kv_index, mask, q_index, out_rows, scale):
    return torch.empty_like(q)  # (T, Hq, D)


@functools.cache
def _head_starts(kv_heads: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """(Hkv, 1) first row of each KV head in a pool tensor viewed as (Hkv * S, D)."""
    return torch.arange(0, kv_heads * num_slots, num_slots, device=device).unsqueeze(1)


def fresh_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                           scale: float) -> torch.Tensor:
    """Prefill from scratch: q (T, Hq, D), k/v (T, Hkv, D), requests' rows consecutive, lens[b]
    rows each -> (T, Hq, D). Every key is a new token, so each request attends over its own rows
    with is_causal, unpadded and with no mask: SDPA's kernels then skip the blocks above the
    diagonal, where a padded masked batch pays for every (max Q, max K) score
    (about half of the prefill time of `train.data`'s long document prompts in a CPU profile)."""
    outs = []
    for qb, kb, vb in zip(q.split(lens), k.split(lens), v.split(lens)):
        qb, kb, vb = qb.transpose(0, 1).unsqueeze(0), kb.transpose(0, 1).unsqueeze(0), vb.transpose(0, 1).unsqueeze(0)
        out = masked_attention(qb, kb, vb, None, scale, expand_kv=q.is_cuda)  # (1, Hq, n_b, D)
        outs.append(out[0].transpose(0, 1))  # (n_b, Hq, D)
    return torch.cat(outs)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     expand_kv: bool) -> torch.Tensor:
    """q (B, Hq, Q, D), k/v (B, Hkv, K, D), mask (B, 1, Q, K) bool -> (B, Hq, Q, D); mask None:
    causal (Q == K, every key a new token). On CPU, SDPA, except where `widened_pays` (bf16 decode rows
    of a few requests, without AMX: SDPA in fp32) or `grouped_pays`: many requests
    of a few queries each, whose KV heads' query rows then run stacked in two batched products
    (`grouped_attention`). Session 17 measured such products 7-13% dearer than SDPA over a strided
    (head-major) gather at 1-32 requests; over a contiguous (B, Hkv, K, D) gather they are cheaper
    where `grouped_pays` (docs/benchmarks.md, "Session 35").

    expand_kv (the CUDA path): give every query head its own view of its KV head instead of
    SDPA's enable_gqa, and run SDPA's memory-efficient kernel. With a mask, enable_gqa falls back
    to the math kernel, which repeats the KV heads with repeat_interleave and so waits for the GPU
    in every layer; and SDPA's default pick for a masked call, cuDNN, spends ~1.5 ms of host time
    per call (profiled on an H200, whatever the batch: half of a decode step), where the
    memory-efficient kernel takes ~0.1 ms. On CPU, enable_gqa reads each KV head once, which is
    cheaper there."""
    causal = mask is None
    if not expand_kv:
        if not causal and widened_pays(q.dtype, q.shape[0], q.shape[2], k.shape[2]):
            return widened_attention(q, k, v, mask, scale)
        if not causal and grouped_pays(q.dtype, q.shape[0], q.shape[2], k.shape[2]):
            return grouped_attention(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(_CUDA_BACKENDS):
        return F.scaled_dot_product_attention(q, repeat_kv_heads(k, group), repeat_kv_heads(v, group),
                                              attn_mask=mask, is_causal=causal, scale=scale)


_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Where `grouped_attention` beats SDPA on CPU, per dtype: (fewest query rows, i.e. requests x queries;
# fewest and most queries a request). SDPA's CPU kernel runs a small product per (request, query head),
# a fixed cost that dominates at a few queries over a few hundred keys; two batched products per
# (request, KV head) spread it over the head group. The default model's whole target forward, grouped
# over SDPA (`bench.attention`, bench/results/attention_s35_forward.json: SmolLM2's 9 query / 3 KV heads,
# 2 threads, AMX Xeon; docs/benchmarks.md "Session 35"): bf16 0.70-0.90x at 32-64 requests of 2 queries,
# 0.80-0.93x of 4, 0.84-0.94x at 16 of 2-4 (128-512 keys); one query 0.93-1.04x at 32-64 requests over
# equal contexts but 0.60-0.89x a call over ragged ones in another run, so left to SDPA; fp32 0.94-1.03x
# at 16-64 requests of one query, 0.99-1.09x of two (left to SDPA). Elsewhere, and for longer queries, SDPA.
# bf16 on a CPU with AVX512-BF16 but no AMX follows `_grouped_pays_bf16_without_amx` instead.
GROUPED_SHAPES = {torch.bfloat16: (32, 2, 4), torch.float32: (16, 1, 1)}
# The most queries a request has in a decode or verify call (a tree's nodes): longer ones stay on SDPA.
GROUPED_MAX_QUERIES = 16


@functools.cache
def bf16_sdpa_without_amx() -> bool:
    """Whether this CPU runs bf16 natively (AVX512-BF16) but without AMX, where SDPA's bf16 CPU kernel
    has no fast product: on an AMD Zen 5 (2 threads, SmolLM2's heads) one request's decode call over
    512 keys took 248 us in bf16 against 31 us in fp32 (bench/results/attention_s46_kernel.json)."""
    return torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()


def grouped_pays(dtype: torch.dtype, batch: int, queries: int, keys: int) -> bool:
    """Whether a CPU attention call of `batch` requests with `queries` queries each over `keys` keys
    (the longest request's) runs grouped."""
    if dtype == torch.bfloat16 and bf16_sdpa_without_amx():
        return _grouped_pays_bf16_without_amx(batch, queries, keys)
    if dtype not in GROUPED_SHAPES:
        return False
    min_rows, fewest, most = GROUPED_SHAPES[dtype]
    return fewest <= queries <= most and batch * queries >= min_rows


# bf16 decode rows without AMX attend through SDPA in fp32 while requests x keys stay under this.
WIDENED_MAX_KEYS = 1024


def widened_pays(dtype: torch.dtype, batch: int, queries: int, keys: int) -> bool:
    """Whether a CPU attention call of `batch` requests with `queries` queries each over `keys` keys runs
    as SDPA over its operands upcast to fp32. Where SDPA's bf16 kernel is slow (`bf16_sdpa_without_amx`)
    its fp32 kernel over the upcast operands beats both bf16 paths for one query a request over a few
    keys in all: 0.25-0.56x bf16 SDPA's time and 0.37-0.91x grouped's a call where this picks it
    (bench/results/attention_s46_kernel.json); the default model's bf16 decode steps with each path in
    turn (AMD Zen 5, docs/benchmarks.md "Session 46"): 0.94x / 0.84x / 0.87x / 0.93x the step at 1 / 2 /
    4 / 8 requests over 60-156 keys, 0.90x / 0.89x / 0.90x at 1 / 2 / 4 over 200-296 and 0.97x at 4 over
    400-496, but 1.01x at 16 over 60-156 and 1.08x at 8 over 400-496. Over 8-16 queries (a tree at one
    request) it is no faster than bf16 SDPA."""
    return (dtype == torch.bfloat16 and bf16_sdpa_without_amx() and queries == 1
            and batch * keys < WIDENED_MAX_KEYS)


def _grouped_pays_bf16_without_amx(batch: int, queries: int, keys: int) -> bool:
    """bf16 without AMX (`bench.attention --mode kernel`, AMD Zen 5, 2 threads, SmolLM2's 9 / 3 heads,
    bench/results/attention_s46_kernel.json). SDPA's time grows with the keys it reads, ~0.5 us a key
    for one request's query, where grouped costs ~50 us at least: one query a request runs grouped from
    ~128 keys in all (0.07-0.56x SDPA's time at 4-64 requests, 0.16-0.92x at one request over 128-1024
    keys, 1.49x over 64; fewer keys in all go to `widened_pays` first). Several queries a request (verify)
    run grouped from 4 requests (0.21-1.12x, but 1.56x at 64 requests of 16 queries over 1024 keys) or 512
    keys (0.51-1.05x); a few requests over a short context stay on SDPA (1.2-2.3x over 64-128 keys)."""
    if queries > GROUPED_MAX_QUERIES:
        return False
    if queries == 1:
        return batch * keys >= 128
    return batch >= 4 or keys >= 512


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """masked_attention as two batched products per (request, KV head), its query heads' rows stacked:
    q (B, Hq, Q, D), k/v (B, Hkv, K, D) contiguous, mask (B, 1, Q, K) bool -> (B, Hq, Q, D). Scores
    come out of the product in q's dtype and the softmax runs in float32 (as Hugging Face's eager
    attention); each query row keeps at least one key, so no row is all -inf."""
    batch, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(batch, kv_heads, group * queries, dim), k.transpose(-1, -2))  # (B, Hkv, G*Q, K)
    scores = scores.float().mul_(scale).view(batch, kv_heads, group, queries, keys)
    scores.masked_fill_(~mask.view(batch, 1, 1, queries, keys), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(batch, kv_heads, group * queries, keys)
    return torch.matmul(probs, v).view(batch, heads, queries, dim)


def widened_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """masked_attention as SDPA over its operands upcast to fp32 (exact): fp32 products and softmax, one
    rounding of the output to q's dtype. q (B, Hq, Q, D), k/v (B, Hkv, K, D), mask (B, 1, Q, K) -> (B, Hq, Q, D)."""
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.to(q.dtype)


def repeat_kv_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, Hkv, N, D) -> (B, Hkv * group, N, D): query head h reads KV head h // group. An expand
    and one copy, where repeat_interleave on CUDA first waits for the GPU to size its output."""
    b, hkv, n, d = x.shape
    return x.unsqueeze(2).expand(b, hkv, group, n, d).reshape(b, hkv * group, n, d)
