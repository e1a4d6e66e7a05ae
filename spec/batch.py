"""Batch-level state that travels between the scheduler, the draft and the target.

Every class holds only tensors and plain values (cheap through Ray channels), and follows
one protocol: `create_idle(...)` builds a zero-row input of the right widths, `merge(other)`
appends another batch's requests, `filter(keep)` keeps the listed request rows, and
`num_requests` counts rows. Idle inputs exist so that a phase with no work (a data-parallel
rank without requests, a prefill step's propose phase) still runs in a compiled graph.

Widths of idle inputs always come from a `HiddenStateSpec` built by `spec.shapes`, never
from the other side's config: the draft's recurrent hidden width and the target hidden
width fed to the draft differ for EAGLE-3 and must never be confused.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from spec.shapes import HiddenStateSpec, ShapeContractError

Keep = Sequence[int] | torch.Tensor


def _keep_index(keep: Keep, num_rows: int) -> torch.Tensor:
    index = torch.as_tensor(keep).reshape(-1)
    if index.dtype == torch.bool:
        index = index.nonzero().flatten()
    index = index.to(torch.long)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_rows):
        raise IndexError(f"filter: row index out of range for a batch of {num_rows} requests")
    return index


def _cat_rows(name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Concatenate along rows; both None (no hidden states) stays None."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        raise ShapeContractError(f"merge: {name} is None on one side only")
    if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
        raise ShapeContractError(
            f"merge: {name} shapes disagree: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        )
    return torch.cat([a, b.to(a.device)], dim=0)


def _cat_padded(a: torch.Tensor, b: torch.Tensor, pad: int) -> torch.Tensor:
    """Concatenate (B, L) tensors whose second dims may differ, padding with `pad`."""
    width = max(a.shape[1], b.shape[1])
    def widen(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == width:
            return x
        out = torch.full((x.shape[0], width), pad, dtype=x.dtype, device=x.device)
        out[:, : x.shape[1]] = x
        return out
    return torch.cat([widen(a), widen(b)], dim=0)


class _RowBatch:
    """merge/filter for dataclasses whose tensor fields all have one row per request."""

    def _row_fields(self) -> list[str]:
        return [f.name for f in fields(self)]  # type: ignore[arg-type]

    @property
    def num_requests(self) -> int:
        return int(getattr(self, self._row_fields()[0]).shape[0])

    def merge(self, other):
        if type(other) is not type(self):
            raise ShapeContractError(f"merge: cannot merge {type(other).__name__} into {type(self).__name__}")
        return replace(self, **{n: _cat_rows(n, getattr(self, n), getattr(other, n)) for n in self._row_fields()})

    def filter(self, keep: Keep):
        index = _keep_index(keep, self.num_requests)
        return replace(
            self,
            **{
                n: None if getattr(self, n) is None else getattr(self, n).index_select(0, index.to(getattr(self, n).device))
                for n in self._row_fields()
            },
        )


@dataclass
class DraftInput(_RowBatch):
    """State the draft needs to propose for each running request (row i = request i).

    verified_id:   (B,)   last token the target produced; not yet in any KV cache
    hidden_states: (B, Hd) the draft's recurrent hidden state (EAGLE/EAGLE3), None otherwise
    topk_p:        (B, K) the draft's top-k probabilities for the token after verified_id
    topk_index:    (B, K) their target-vocabulary ids (K = 0 where the draft has not seen verified_id yet)
    """

    verified_id: torch.Tensor
    hidden_states: torch.Tensor | None
    topk_p: torch.Tensor
    topk_index: torch.Tensor

    @classmethod
    def create_idle(cls, spec: HiddenStateSpec | None, topk: int) -> "DraftInput":
        return cls(
            verified_id=torch.zeros(0, dtype=torch.long),
            hidden_states=None if spec is None else spec.empty(0),
            topk_p=torch.zeros((0, topk), dtype=torch.float32),
            topk_index=torch.zeros((0, topk), dtype=torch.long),
        )


def placeholder_draft_input(verified_id: torch.Tensor, spec: HiddenStateSpec | None, topk: int) -> DraftInput:
    """Rows of the right widths that carry only the verified ids: what the batch holds while
    the draft is down (decoding goes on without speculation until a resync refills it)."""
    batch = verified_id.shape[0]
    return DraftInput(
        verified_id=verified_id,
        hidden_states=None if spec is None else spec.empty(batch),
        topk_p=torch.zeros((batch, topk), dtype=torch.float32),
        topk_index=torch.zeros((batch, topk), dtype=torch.long),
    )


@dataclass
class VerifyInput(_RowBatch):
    """A draft tree per request for the target to verify (N nodes, node 0 = verified_id).

    draft_tokens: (B, N)    token at each node
    parents:      (B, N)    parent node of each node (-1 for the root): the retrieve structure
                            that turns the accepted leaf back into a path
    positions:    (B, N)    absolute position of each node (root position + depth)
    tree_mask:    (B, N, N) node i may attend to node j (j is i or an ancestor of i)
    A chain is the tree whose node i has parent i - 1.
    """

    draft_tokens: torch.Tensor
    parents: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor

    @classmethod
    def create_idle(cls, num_draft_tokens: int) -> "VerifyInput":
        n = num_draft_tokens
        return cls(
            draft_tokens=torch.zeros((0, n), dtype=torch.long),
            parents=torch.zeros((0, n), dtype=torch.long),
            positions=torch.zeros((0, n), dtype=torch.long),
            tree_mask=torch.zeros((0, n, n), dtype=torch.bool),
        )

    @property
    def num_draft_tokens(self) -> int:
        return int(self.draft_tokens.shape[1])


@dataclass
class DraftExtendInput:
    """Tokens the target just committed to its KV cache, for the draft to catch up on.

    Ragged: request i owns rows offsets[i] : offsets[i] + extend_lens[i] of the token fields.
    tokens:        (T,)      committed tokens (prefill: the prompt; decode: root + accepted drafts); None,
                             as positions and hidden_states, in what returns to the scheduler (`for_scheduler`)
    next_tokens:   (T,)      the token following each one; a request's last entry is its new verified id
    positions:     (T,)
    slots:         (T,)      KV slots holding them (the scheduler frees the other verify slots)
    hidden_states: (T, Ht)   target hidden rows the draft consumes (EAGLE: last layer; EAGLE3:
                             concatenated aux layers), None for STANDALONE / NGRAM / NONE
    extend_lens:   (B,)
    accept_lens:   (B,)      accepted draft tokens per request (0 for prefill)
    logprobs:      (T,)      raw logprob of each next_token, where a request asked (else 0)
    top_logprobs:  (T, K)    the K most likely tokens' raw logprobs there (K = the batch's largest ask, or 0)
    top_ids:       (T, K)    their ids
    tree_nodes:    (B,)      nodes the target verified for each request, root included (its tree after
                             the draft's `min_path_prob` cut; 0 for prefill): what the step really cost
    tree_depths:   (B,)      depth of each verified tree (its deepest node's distance from the root; 0 for prefill)
    accepted_nodes:(B, A)    tree node of each accepted draft token, -1 past accept_lens (A: the most
                             accepted; 0 for prefill). Nodes are ranked best first (`select_tree`), so
                             the tree of the n best would have accepted those below n: what each
                             smaller tree keeps of this one's acceptance, measured (`actors.cost_model`)
    catch_up_tokens, catch_up_s: the step's draft catch-up (tokens that waited behind plain steps or
                             deferred prompt chunks, extended over in one forward) and its seconds,
                             timed by the drafter and set by its `extend`: what the tree-size policy
                             prices a catch-up at, measured rather than inferred from whole steps
    """

    tokens: torch.Tensor
    next_tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    hidden_states: torch.Tensor | None
    extend_lens: torch.Tensor
    accept_lens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    tree_nodes: torch.Tensor | None = None
    tree_depths: torch.Tensor | None = None
    accepted_nodes: torch.Tensor | None = None
    catch_up_tokens: int = 0
    catch_up_s: float = 0.0

    _TOKEN_FIELDS = ("tokens", "next_tokens", "positions", "slots", "hidden_states")
    _LOGPROB_FIELDS = ("logprobs", "top_logprobs", "top_ids")
    _REQUEST_FIELDS = ("extend_lens", "accept_lens", "tree_nodes", "tree_depths")

    def __post_init__(self) -> None:
        if self.logprobs is None:  # nobody asked: zero-width tops, one float per row
            rows = self.tokens.shape[0]
            self.logprobs = torch.zeros(rows)
            self.top_logprobs = torch.zeros((rows, 0))
            self.top_ids = torch.zeros((rows, 0), dtype=torch.long)
        for name in ("tree_nodes", "tree_depths"):  # no tree verified (prefill, catch-up)
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros_like(self.extend_lens))
        if self.accepted_nodes is None:
            self.accepted_nodes = torch.zeros((self.num_requests, 0), dtype=torch.long)

    @classmethod
    def create_idle(cls, spec: HiddenStateSpec | None) -> "DraftExtendInput":
        empty = torch.zeros(0, dtype=torch.long)
        return cls(
            tokens=empty, next_tokens=empty.clone(), positions=empty.clone(), slots=empty.clone(),
            hidden_states=None if spec is None else spec.empty(0),
            extend_lens=empty.clone(), accept_lens=empty.clone(),
        )

    @property
    def num_requests(self) -> int:
        return int(self.extend_lens.shape[0])

    @property
    def offsets(self) -> torch.Tensor:
        """(B,) first token row of each request."""
        return torch.cumsum(self.extend_lens, 0) - self.extend_lens

    def _new_rows(self) -> list[slice]:
        """Per request, the rows whose next_tokens are new output: accepted drafts then the bonus."""
        return [slice(start + length - acc - 1, start + length) for start, length, acc in
                zip(self.offsets.tolist(), self.extend_lens.tolist(), self.accept_lens.tolist())]

    def new_token_ids(self) -> list[list[int]]:
        """Per request, the tokens to append to its output: accepted drafts then the bonus token."""
        nxt = self.next_tokens.tolist()
        return [nxt[rows] for rows in self._new_rows()]

    def new_logprobs(self) -> list[list[tuple[float, list[tuple[int, float]]]]]:
        """Per request and new token: (its logprob, [(top id, top logprob), ...])."""
        lps, tops, ids = self.logprobs.tolist(), self.top_logprobs.tolist(), self.top_ids.tolist()
        return [[(lps[i], list(zip(ids[i], tops[i]))) for i in range(rows.start, rows.stop)]
                for rows in self._new_rows()]

    def for_scheduler(self) -> "DraftExtendInput":
        """The same batch minus what only the draft reads (the hidden rows, the committed tokens and
        their positions): what a runner actor sends back to the scheduler, each tensor a cost on the hop."""
        return replace(self, hidden_states=None, tokens=None, positions=None)

    def merge(self, other: "DraftExtendInput") -> "DraftExtendInput":
        if type(other) is not type(self):
            raise ShapeContractError(f"merge: cannot merge {type(other).__name__} into DraftExtendInput")
        merged = {n: _cat_rows(n, getattr(self, n), getattr(other, n)) for n in self._TOKEN_FIELDS}
        merged["logprobs"] = torch.cat([self.logprobs, other.logprobs])
        merged["top_logprobs"] = _cat_padded(self.top_logprobs, other.top_logprobs, 0)
        merged["top_ids"] = _cat_padded(self.top_ids, other.top_ids, 0)
        merged.update({n: torch.cat([getattr(self, n), getattr(other, n)]) for n in self._REQUEST_FIELDS})
        merged["accepted_nodes"] = _cat_padded(self.accepted_nodes, other.accepted_nodes, -1)
        return replace(self, **merged)

    def filter(self, keep: Keep) -> "DraftExtendInput":
        index = _keep_index(keep, self.num_requests)
        starts, lens = self.offsets[index], self.extend_lens[index]
        rows = (
            torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())])
            if index.numel() else torch.zeros(0, dtype=torch.long)
        )
        kept = {
            n: None if getattr(self, n) is None else getattr(self, n).index_select(0, rows.to(getattr(self, n).device))
            for n in (*self._TOKEN_FIELDS, *self._LOGPROB_FIELDS)
        }
        kept.update({n: getattr(self, n)[index] for n in (*self._REQUEST_FIELDS, "accepted_nodes")})
        return replace(self, **kept)


@dataclass
class BatchMeta(_RowBatch):
    """What every phase needs about the requests of one step (row i = request i).

    The scheduler builds it fresh each step; runners keep no per-request state, so a
    restarted runner only needs its KV refilled.
    seq_lens:      (B,)    tokens already in the KV cache (= position of the next new token)
    kv_slots:      (B, L)  committed KV slots, row i valid up to seq_lens[i]
    prefill_lens:  (B,)    tokens to extend in a prefill step (0 in a decode step)
    prefill_tokens:(B, P)  those tokens, padded
    prefill_slots: (B, P)  their KV slots, padded
    next_token:    (B,)    prefill: a known next token (recovery re-prefill), or -1 to sample one
    scratch_slots: (B, S)  slots the draft may write while proposing (freed after the step)
    verify_slots:  (B, N)  slots for the verify tree (accepted ones are kept)
    temperature, top_p, min_p: (B,) float;  top_k, seeds: (B,) long
    history:       (B, Lh) prompt + output tokens, padded with -1 (NGRAM lookup and penalties; else (B, 0))
    prompt_lens:   (B,)    prompt tokens at the head of each history row
    num_output:    (B,)    output tokens before the first one this step chooses
    min_tokens:    (B,)    long;  repetition_penalty, presence_penalty, frequency_penalty: (B,) float
    stop_ids:      (B, Ks) ids min_tokens holds back, padded with -1
    bias_ids:      (B, Kb) logit_bias ids, padded with -1;  bias_values: (B, Kb) float
    num_logprobs:  (B,)    top logprobs to return per token, -1 for none
    defer_draft:   (B,)    bool: a prefill row whose draft extend waits (the load decodes plain; the
                           draft catches up when a tree next drafts for the request)
    """

    seq_lens: torch.Tensor
    kv_slots: torch.Tensor
    prefill_lens: torch.Tensor
    prefill_tokens: torch.Tensor
    prefill_slots: torch.Tensor
    next_token: torch.Tensor
    scratch_slots: torch.Tensor
    verify_slots: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seeds: torch.Tensor
    history: torch.Tensor
    # Processor and logprob inputs; None (the default) means neutral for every row.
    min_p: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None
    num_output: torch.Tensor | None = None
    min_tokens: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    stop_ids: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    num_logprobs: torch.Tensor | None = None
    defer_draft: torch.Tensor | None = None

    _NEUTRAL = {"min_p": (0.0, torch.float32), "prompt_lens": (0, torch.long), "num_output": (0, torch.long),
                "min_tokens": (0, torch.long), "repetition_penalty": (1.0, torch.float32),
                "presence_penalty": (0.0, torch.float32), "frequency_penalty": (0.0, torch.float32),
                "num_logprobs": (-1, torch.long), "defer_draft": (False, torch.bool)}

    def __post_init__(self) -> None:
        rows = self.seq_lens.shape[0]
        for name, (value, dtype) in self._NEUTRAL.items():
            if getattr(self, name) is None:
                setattr(self, name, torch.full((rows,), value, dtype=dtype))
        for name, dtype in (("stop_ids", torch.long), ("bias_ids", torch.long), ("bias_values", torch.float32)):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros((rows, 0), dtype=dtype))

    _PADDED = {"kv_slots": 0, "prefill_tokens": 0, "prefill_slots": 0, "history": -1, "stop_ids": -1,
               "bias_ids": -1, "bias_values": 0, "scratch_slots": 0, "verify_slots": 0}

    @classmethod
    def create_idle(cls, scratch: int = 0, num_draft_tokens: int = 1) -> "BatchMeta":
        long0 = lambda *s: torch.zeros((0, *s), dtype=torch.long)  # noqa: E731
        return cls(
            seq_lens=long0(), kv_slots=long0(0), prefill_lens=long0(), prefill_tokens=long0(0),
            prefill_slots=long0(0), next_token=long0(), scratch_slots=long0(scratch),
            verify_slots=long0(num_draft_tokens), temperature=torch.zeros(0), top_p=torch.ones(0),
            top_k=long0(), seeds=long0(), history=long0(0),
        )

    @property
    def is_prefill(self) -> bool:
        """Some row extends over prompt tokens (a prefill step, or a mixed one)."""
        return bool(self.prefill_lens.numel()) and int(self.prefill_lens.max()) > 0

    @property
    def num_decode(self) -> int:
        """Rows that decode (nothing to prefill). A mixed step puts them first, its prefill
        chunks after them; the DraftInput and VerifyInput of a step hold only these rows."""
        return int((self.prefill_lens == 0).sum())

    def decode_part(self) -> "BatchMeta":
        """The decode rows (all of a decode step's rows, none of a prefill step's)."""
        d = self.num_decode
        return self if d == self.num_requests else self.filter(torch.arange(d))

    def prefill_part(self) -> "BatchMeta":
        """The prefill rows, after the decode rows."""
        d = self.num_decode
        return self if d == 0 else self.filter(torch.arange(d, self.num_requests))

    def merge(self, other: "BatchMeta") -> "BatchMeta":
        if type(other) is not BatchMeta:
            raise ShapeContractError(f"merge: cannot merge {type(other).__name__} into BatchMeta")
        merged = {}
        for name in self._row_fields():
            a, b = getattr(self, name), getattr(other, name)
            merged[name] = _cat_padded(a, b, self._PADDED[name]) if name in self._PADDED else _cat_rows(name, a, b)
        return replace(self, **merged)
