"""Ragged attention over a token-slot KV pool.

Each layer owns one K and one V tensor of shape (kv_heads, num_slots, head_dim); the
scheduler hands out slot ids. A forward pass carries, per request, the slots of its
committed context (prefix) and of its new tokens, plus a mask among the new tokens
(causal for prefill, a tree mask for verify). Linear layers run on the flat (T, H) token
rows; only attention pads requests to (B, Q, K), with one metadata object shared by every
layer of the pass.
"""

from __future__ import annotations

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
        """prefix_slots[b]: (P_b,) committed slots; new_slots[b]: (n_b,) slots of its new tokens
        (flat order = requests in order); new_masks[b]: (n_b, n_b) bool or None for causal.

        Built with a fixed number of tensor ops whatever the batch (a Python loop over requests
        cost ~0.3 ms a request on the 2-core CPU, a tenth of a 32-request decode step); only tree
        masks of different sizes are placed one request at a time."""
        batch = len(new_slots)
        prefix_lens = torch.tensor([int(p.numel()) for p in prefix_slots], dtype=torch.long)  # (B,)
        new_lens = torch.tensor([int(s.numel()) for s in new_slots], dtype=torch.long)
        fresh = not bool(prefix_lens.any()) and all(m is None for m in new_masks)  # unpadded already
        runs = [] if fresh else _query_runs(new_lens)
        if len(runs) > 1:
            return cls._in_parts(runs, prefix_slots, new_slots, positions, new_masks, new_lens, device)
        kv_lens = prefix_lens + new_lens
        max_q = int(new_lens.max()) if batch else 0
        max_k = int(kv_lens.max()) if batch else 0
        total = int(new_lens.sum())
        # Each request's keys: its prefix then its new slots, zero-padded to the longest.
        kv_index = pad_sequence([torch.cat((p.long(), s.long())) for p, s in zip(prefix_slots, new_slots)],
                                batch_first=True) if batch else torch.zeros((0, 0), dtype=torch.long)
        q_pos, k_pos = torch.arange(max_q), torch.arange(max_k)
        valid_q = q_pos < new_lens.unsqueeze(1)  # (B, Q)
        # Causal: query q of request b sees keys up to P_b + q (its whole prefix included).
        mask = (k_pos <= (prefix_lens.unsqueeze(1) + q_pos).unsqueeze(2)) & valid_q.unsqueeze(2)  # (B, Q, K)
        trees = [b for b, m in enumerate(new_masks) if m is not None]
        if trees:
            _place_tree_masks(mask, trees, new_masks, prefix_lens, new_lens)
        q_index = torch.where(valid_q, (new_lens.cumsum(0) - new_lens).unsqueeze(1) + q_pos, total)
        # Padded query rows attend to one key so softmax stays finite; their output is dropped.
        mask[..., 0] |= ~valid_q
        return cls(
            positions=positions.to(device),
            out_slots=torch.cat(new_slots).to(device) if new_slots else torch.zeros(0, dtype=torch.long, device=device),
            kv_index=kv_index.to(device),
            mask=mask.unsqueeze(1).to(device),
            q_index=q_index.to(device),
            out_rows=valid_q.flatten().nonzero().flatten().to(device),
            padded=total != batch * max_q,
            fresh_lens=new_lens.tolist() if not bool(prefix_lens.any()) and not trees else None,
        )

    @classmethod
    def _in_parts(cls, runs: list[tuple[int, int]], prefix_slots, new_slots, positions, new_masks,
                  new_lens: torch.Tensor, device) -> "AttentionMetadata":
        """One part per run of consecutive requests (see `_query_runs`); the K/V of every new
        token is still written at once, through the whole pass's out_slots."""
        rows = [0] + new_lens.cumsum(0).tolist()
        parts = [(rows[a], rows[b], cls.build(prefix_slots[a:b], new_slots[a:b], positions[rows[a]:rows[b]],
                                              new_masks[a:b], device)) for a, b in runs]
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return cls(positions=positions.to(device), out_slots=torch.cat(new_slots).to(device), kv_index=empty,
                   mask=empty.bool(), q_index=empty, out_rows=empty, padded=False, parts=parts)


# Requests with more new tokens than this (prefill chunks) attend apart from the others.
LONG_QUERIES = 16


def _query_runs(new_lens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) request ranges of consecutive requests alike in having more than LONG_QUERIES
    new tokens or not: one range for an ordinary decode or prefill step, two for a mixed step
    (its decode rows first, then its prefill chunks)."""
    long = (new_lens > LONG_QUERIES).tolist()
    cuts = [i for i in range(1, len(long)) if long[i] != long[i - 1]]
    bounds = [0, *cuts, len(long)]
    return list(zip(bounds[:-1], bounds[1:]))


def _place_tree_masks(mask: torch.Tensor, trees: list[int], new_masks: list[torch.Tensor | None],
                      prefix_lens: torch.Tensor, new_lens: torch.Tensor) -> None:
    """Overwrite the new-token block of mask (B, Q, K) with each listed request's own (n_b, n_b)
    mask, at columns P_b .. P_b + n_b: one scatter when every request has a mask of one size (a
    verify step), else one request at a time."""
    batch, n = mask.shape[0], int(new_lens[trees[0]])
    if len(trees) == batch and bool((new_lens == n).all()):
        cols = (prefix_lens.unsqueeze(1) + torch.arange(n)).unsqueeze(1).expand(batch, n, n)  # (B, n, n)
        mask.scatter_(2, cols, torch.stack(new_masks).bool())  # type: ignore[arg-type]
        return
    for b in trees:
        p, n = int(prefix_lens[b]), int(new_lens[b])
        mask[b, :n, p : p + n] = new_masks[b]


class KVPool:
    """Per-layer K/V tensors indexed by slot ids: (kv_heads, num_slots, head_dim) each.

    Head-major, so that gathering a batch's slots gives each KV head's keys as one contiguous
    (B * K, D) block: the attention products then read them as (Hkv * B) plain matrices, where a
    slot-major pool's gather had to be copied once more into that layout in every layer (the
    largest of the small ops of a batch-16 decode step in a CPU profile)."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (kv_heads, num_slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens, caches (Hkv, S, D) -> (T, Hq, D).

    Writes the new K/V into their slots, then attends over each request's gathered slots.
    """
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
    gather = meta.kv_index.flatten()
    keys = k_cache.index_select(1, gather).view(k_cache.shape[0], batch, -1, dim)  # (Hkv, B, K, D)
    values = v_cache.index_select(1, gather).view(v_cache.shape[0], batch, -1, dim)
    if use_grouped(q, num_q):
        out = grouped_attention(q_pad, keys, values, meta.mask, scale)  # (B, Q, Hq, D)
    else:
        out = masked_attention(q_pad.transpose(1, 2), keys.transpose(0, 1), values.transpose(0, 1), meta.mask, scale,
                               expand_kv=q.is_cuda).transpose(1, 2)  # (B, Q, Hq, D)
    out = out.reshape(batch * num_q, heads, dim)
    return out.index_select(0, meta.out_rows) if meta.padded else out  # (T, Hq, D)


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
    causal (Q == K, every key a new token). SDPA; `paged_attention` sends decode and verify
    (`use_grouped`) to `grouped_attention` instead.

    expand_kv (the CUDA path): give every query head its own view of its KV head instead of
    SDPA's enable_gqa, and run SDPA's memory-efficient kernel. With a mask, enable_gqa falls back
    to the math kernel, which repeats the KV heads with repeat_interleave and so waits for the GPU
    in every layer; and SDPA's default pick for a masked call, cuDNN, spends ~1.5 ms of host time
    per call (profiled on an H200, whatever the batch: half of a decode step), where the
    memory-efficient kernel takes ~0.1 ms. On CPU, enable_gqa reads each KV head once, which is
    cheaper there."""
    causal = mask is None
    if not expand_kv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(_CUDA_BACKENDS):
        return F.scaled_dot_product_attention(q, repeat_kv_heads(k, group), repeat_kv_heads(v, group),
                                              attn_mask=mask, is_causal=causal, scale=scale)


_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_GROUPED_DTYPES = (torch.bfloat16,)  # where it was measured to pay; fp16 stays on SDPA
GROUPED_MAX_QUERIES = 16


def use_grouped(q: torch.Tensor, num_q: int) -> bool:
    """Whether a masked pass with `num_q` queries per request goes to `grouped_attention`: bf16
    on CPU, at most GROUPED_MAX_QUERIES queries per request (decode and verify), where SDPA's CPU
    flash kernel took 4-8x its fp32 time. Longer queries (prefill over a cached prefix) stay on
    SDPA, whose blocked kernel never holds the (Q, K) scores whole and was faster from ~64
    queries on."""
    return q.device.type == "cpu" and q.dtype in _GROUPED_DTYPES and num_q <= GROUPED_MAX_QUERIES


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q (B, Q, Hq, D), k/v (Hkv, B, K, D) head-major as the pool gathers them, mask (B, 1, Q, K)
    bool -> (B, Q, Hq, D), as two batched matmuls in the inputs' dtype (oneDNN's native bf16
    products, fp32 accumulation) with the scale, mask and softmax in fp32. The G = Hq / Hkv query
    heads that share a KV head become G * Q rows of one product, so each KV head is read once
    and never repeated, and the (Hkv * B) keys matrices are read in place.

    On the 2-core AVX512-BF16 CPU, at 16 requests x 1 query x 200 keys (SmolLM2-135M's 9/3
    heads): 1.7 ms against SDPA's 8.1 ms in bf16 (and SDPA's 1.2 ms in fp32); 1000 keys: 3.3
    against 33 ms (docs/benchmarks.md)."""
    b, nq, hq, d = q.shape
    hkv, nk = k.shape[0], k.shape[2]
    group = hq // hkv
    rows = q.view(b, nq, hkv, group, d).permute(2, 0, 3, 1, 4).reshape(hkv * b, group * nq, d)  # (Hkv * B, G * Q, D)
    scores = torch.bmm(rows, k.view(hkv * b, nk, d).transpose(1, 2))  # (Hkv * B, G * Q, K)
    scores = scores.view(hkv, b, group, nq, nk).float() * scale
    scores = scores.masked_fill_(~mask.view(1, b, 1, nq, nk), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(hkv * b, group * nq, nk)
    out = torch.bmm(probs, v.view(hkv * b, nk, d))  # (Hkv * B, G * Q, D)
    return out.view(hkv, b, group, nq, d).permute(1, 3, 0, 2, 4).reshape(b, nq, hq, d)


def repeat_kv_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, Hkv, N, D) -> (B, Hkv * group, N, D): query head h reads KV head h // group. An expand
    and one copy, where repeat_interleave on CUDA first waits for the GPU to size its output."""
    b, hkv, n, d = x.shape
    return x.unsqueeze(2).expand(b, hkv, group, n, d).reshape(b, hkv * group, n, d)
