"""Drafters: propose a tree of tokens per request, then catch up on what the target committed.

    propose(meta, DraftInput) -> VerifyInput          (for the decode rows; idle in a prefill step)
    extend(meta, DraftExtendInput) -> DraftInput

DraftRunner wraps a draft model (EAGLE, EAGLE3, STANDALONE) and its KV pool, indexed by
the same slot ids as the target's. NgramDrafter (prompt lookup) and NoDrafter (NONE) have no
model. The scheduler chooses each decode step's tree size (`actors.cost_model`) and says it
through the width of `meta.verify_slots`: every request's tree has that many nodes at most, so
batches stay rectangular; 1 is a plain decode step (the root alone, nothing drafted).
"""

from __future__ import annotations

import time

import torch

from actors.cost_model import MAX_DRAFT_LAG
from actors.cuda_graphs import StepGraphs, pool_slots
from actors.device import parse_dtype, pick_device, set_threads
from actors.pass_rows import PassRows
from models.build import ModelSource, build_draft
from models.cpu_kernels import use_attention_kernel
from models.packed import pack_linears
from spec.algorithm import SpecAlgorithm
from spec.batch import BatchMeta, DraftExtendInput, DraftInput, VerifyInput, placeholder_draft_input
from spec.shapes import get_draft_input_hidden_state_spec, get_draft_recurrent_hidden_state_spec
from spec.tree import ancestor_mask, chain_parents, depths


def _last_rows(ext: DraftExtendInput) -> torch.Tensor:
    """(B,) row of each request's last committed token."""
    return ext.offsets + ext.extend_lens - 1


def _verify_input(root: torch.Tensor, draft: torch.Tensor, parents: torch.Tensor, seq_lens: torch.Tensor) -> VerifyInput:
    """root (B,), draft (B, N-1) tokens, parents (B, N) with -1 at the root -> VerifyInput."""
    tokens = torch.cat([root.unsqueeze(1), draft], dim=1)  # (B, N)
    mask = ancestor_mask(parents)  # (B, N, N)
    return VerifyInput(
        draft_tokens=tokens,
        parents=parents,
        positions=seq_lens.unsqueeze(1) + depths(mask),
        tree_mask=mask,
    )


def step_nodes(meta: BatchMeta, tree_size: int) -> int:
    """Nodes per request this decode step verifies, root included: the width of its verify slots
    (the scheduler's choice), never more than the drafter's tree."""
    return max(1, min(tree_size, int(meta.verify_slots.shape[1])))


def root_only(meta: BatchMeta, draft_input: DraftInput) -> VerifyInput:
    """A plain decode step's tree: each request's root alone."""
    batch = draft_input.num_requests
    return _verify_input(draft_input.verified_id, torch.zeros((batch, 0), dtype=torch.long),
                         chain_parents(batch, 1), meta.seq_lens)


class _ModelFreeDrafter:
    """Shared by NGRAM and NONE: nothing to extend, the next root is the bonus token."""

    hidden_spec = None
    input_spec = None

    def __init__(self, tree_size: int):
        self.tree_size = tree_size

    def extend(self, meta: BatchMeta, ext: DraftExtendInput) -> DraftInput:
        if ext.num_requests == 0:
            return DraftInput.create_idle(None, 0)
        last = _last_rows(ext)
        empty = torch.zeros((ext.num_requests, 0))
        return DraftInput(ext.next_tokens[last], None, empty, empty.long())

    def propose(self, meta: BatchMeta, draft_input: DraftInput) -> VerifyInput:
        batch = draft_input.num_requests
        if batch == 0:
            return VerifyInput.create_idle(self.tree_size)
        meta = meta.decode_part()  # a mixed step's prefill rows have nothing to draft
        nodes = step_nodes(meta, self.tree_size)
        if nodes == 1:
            return root_only(meta, draft_input)
        draft = self._draft_tokens(meta, draft_input, nodes - 1)  # (B, n-1), n <= nodes
        return _verify_input(draft_input.verified_id, draft, chain_parents(batch, draft.shape[1] + 1), meta.seq_lens)

    def _draft_tokens(self, meta: BatchMeta, draft_input: DraftInput, most: int) -> torch.Tensor:
        return torch.zeros((draft_input.num_requests, most), dtype=torch.long)


class NoDrafter(_ModelFreeDrafter):
    """NONE: a one-node tree (the root), i.e. plain decoding through the same verify path."""

    def __init__(self):
        super().__init__(tree_size=1)


def prompt_lookup(history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the history's longest
    suffix of max_ngram down to min_ngram tokens (none when nothing matches)."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


def _histories(meta: BatchMeta) -> list[list[int]]:
    """(B,) prompt + output token lists (meta.history without its -1 padding)."""
    return [[t for t in row if t >= 0] for row in meta.history.tolist()]


class NgramDrafter(_ModelFreeDrafter):
    """Prompt lookup: find the latest earlier occurrence of the request's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it.

    The batch's chains are as long as its longest match (up to num_steps), so a step where
    nothing matches costs what plain decoding costs."""

    def __init__(self, num_steps: int, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(tree_size=num_steps + 1)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def _draft_tokens(self, meta: BatchMeta, draft_input: DraftInput, most: int) -> torch.Tensor:
        found = [prompt_lookup(h, most, self.max_ngram, self.min_ngram) for h in _histories(meta)]
        width = max(map(len, found), default=0)
        out = torch.zeros((draft_input.num_requests, width), dtype=torch.long)
        for b, (tokens, root) in enumerate(zip(found, draft_input.verified_id.tolist())):
            # Shorter proposals are padded by repeating their last token: just more drafts to verify.
            tokens = tokens or [root]
            out[b] = torch.tensor(tokens + [tokens[-1]] * (width - len(tokens)))[:width]
        return out


# A branch needs a match of at least this many tokens: one-token matches are nearly always
# there, and would take tree nodes from the draft model at every step.
NGRAM_BRANCH_MIN = 2


def with_branches(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                  branches: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Force each request's prompt-lookup continuation into its tree as a path from the root.

    scores/tokens/parents (B, P): a draft model's candidate pool (parents index the pool, -1 for
    the root's children). A branch token that the pool already holds under the branch's previous
    node is reused; the others become new pool entries (m = longest branch columns are added,
    unused ones scored -1 so they are never kept). Branch nodes score 2 + m - depth, above any
    path probability and decreasing along the branch, so select_tree keeps the branch first
    (parents before children) and fills the rest of the tree with the model's best candidates."""
    batch, pool = scores.shape
    m = max(map(len, branches), default=0)
    if m == 0:
        return scores, tokens, parents
    scores = torch.cat([scores, scores.new_full((batch, m), -1.0)], dim=1)  # (B, P + m)
    tokens = torch.cat([tokens, tokens.new_zeros((batch, m))], dim=1)
    parents = torch.cat([parents, parents.new_full((batch, m), -1)], dim=1)
    for b, branch in enumerate(branches):
        parent, free = -1, pool
        for depth, token in enumerate(branch):
            same = ((parents[b, :pool] == parent) & (tokens[b, :pool] == token)).nonzero().flatten()
            if same.numel():
                node = int(same[0])
            else:
                node, free = free, free + 1
                tokens[b, node], parents[b, node] = token, parent
            scores[b, node] = 2.0 + m - depth
            parent = node
    return scores, tokens, parents


class DraftRunner:
    """Model-based drafts. EAGLE-family drafts pair the target hidden at position t with the
    token at t + 1 (their KV entry for slot s of token t sees token t + 1); STANDALONE drafts
    store token t at slot s like any LM and consume the root themselves when proposing."""

    def __init__(
        self,
        algorithm: SpecAlgorithm | str,
        draft_model: str,
        target_model: str,
        num_steps: int,
        topk: int,
        tree_size: int,
        num_slots: int = 16384,
        dtype: str | torch.dtype = "float32",
        device: str = "auto",
        num_threads: int | None = None,
        ngram_branch: int = 0,
        min_path_prob: float = 0.0,
        cuda_graphs: bool = True,
        torch_compile: bool = False,
    ):
        set_threads(num_threads)
        self.ngram_branch, self.min_path_prob = ngram_branch, min_path_prob
        self.algorithm = SpecAlgorithm.from_name(algorithm)
        self.device = pick_device(device)
        self.dtype = parse_dtype(dtype, self.device)
        self.num_steps, self.topk, self.tree_size = num_steps, topk, tree_size
        target, draft = ModelSource.resolve(target_model), ModelSource.resolve(draft_model)
        self.model = build_draft(self.algorithm, draft, target, self.dtype, self.device)
        pack_linears(self.model, self.dtype, self.device)
        # On CPU, attention through our C++ kernel (models.cpu_kernels). The draft's forward is not
        # compiled: in a serving step its small passes run on weights the target's pass has just pushed
        # out of the caches, and compiling them bought ~1-2% of a step (docs/benchmarks.md "Session 48").
        self.attention_kernel = torch_compile and use_attention_kernel(self.model, self.dtype, self.device)
        self.kv = self.model.make_kv_pool(pool_slots(num_slots), self.dtype, self.device)
        self.num_slots = num_slots
        # Propose levels and extends through CUDA graphs, one set per input kind (from the target
        # or the draft's own recurrent state): {from_target: StepGraphs}, empty for eager.
        self.graphs: dict[bool, StepGraphs] = {}
        if cuda_graphs and self.device.type == "cuda":
            self.use_step_graphs(capture=True)
        self.input_spec = get_draft_input_hidden_state_spec(self.algorithm, target.config, draft.config, self.dtype)
        self.hidden_spec = get_draft_recurrent_hidden_state_spec(self.algorithm, target.config, draft.config, self.dtype)
        self.shifted = self.algorithm.is_eagle
        self._pending: dict[int, tuple[int, int, int, torch.Tensor | None, int]] = {}  # see _defer
        self._spent = (0, 0.0)  # this step's catch-up so far: tokens, seconds (`extend` reports it)

    def use_step_graphs(self, capture: bool) -> None:
        """Run propose levels and extends through `StepGraphs` (captured when `capture` and on CUDA,
        else the same padded static-buffer passes eagerly: how the CPU tests check them)."""
        self.graphs = {
            flag: StepGraphs(lambda tokens, hidden, attn, flag=flag: self.model.draft_forward(
                tokens, hidden, attn, self.kv, flag), self.device, dump_slot=self.num_slots, capture=capture)
            for flag in (True, False)}

    def _forward(self, rows: PassRows, hidden: torch.Tensor | None, from_target: bool):
        out = self.graphs[from_target].run(rows, hidden) if self.graphs else None
        if out is not None:
            return out
        hidden = None if hidden is None else hidden.to(self.device)
        return self.model.draft_forward(rows.tokens.to(self.device), hidden, rows.metadata(self.device), self.kv,
                                        from_target)

    @torch.inference_mode()
    def extend(self, meta: BatchMeta, ext: DraftExtendInput) -> DraftInput:
        """Write draft KV for the committed tokens; return the next DraftInput per request. The
        tokens of a plain decode step (one verify node) and the prompt chunks the scheduler marks
        (`meta.defer_draft`) wait instead (`_defer`). Sets `ext.catch_up_tokens` / `catch_up_s` to
        the step's catch-ups (its propose's and its own), which `ext` carries back to the scheduler."""
        out = self._extend_step(meta, ext)
        ext.catch_up_tokens, ext.catch_up_s = self._spent
        self._spent = (0, 0.0)
        return out

    def _extend_step(self, meta: BatchMeta, ext: DraftExtendInput) -> DraftInput:
        if ext.num_requests == 0:
            return DraftInput.create_idle(self.hidden_spec, self.topk if self.shifted else 0)
        if self.input_spec is not None:
            self.input_spec.check(ext.hidden_states, "draft.extend input")
        decode = meta.num_decode
        defer = meta.defer_draft.clone()  # (B,) bool
        defer[:decode] = bool(decode) and step_nodes(meta, self.tree_size) == 1
        if not bool(defer.any()):
            return self._extend(meta, ext)
        if bool(defer.all()):
            return self._defer(meta, ext)
        waits, runs = defer.nonzero().flatten(), (~defer).nonzero().flatten()
        out = self._defer(meta.filter(waits), ext.filter(waits)).merge(self._extend(meta.filter(runs), ext.filter(runs)))
        return out.filter(torch.argsort(torch.cat([waits, runs])))  # back in the batch's row order

    def _extend(self, meta: BatchMeta, ext: DraftExtendInput) -> DraftInput:
        """Write the draft KV of `ext`'s tokens (accepted verify rows, prompt chunks, or both)."""
        if self._pending:  # a reused slot's leftover (its request ended while waiting)
            for slot in ext.slots.tolist():
                self._pending.pop(slot, None)
            if meta.is_prefill:
                # A prefix cache hit can end in tokens whose draft KV still waits (the request that
                # computed them ended after plain steps): write it before extending past it.
                part = meta.prefill_part()
                rows, prefix_lens, waiting = self._waiting(part)
                if rows:
                    self._catch_up(part.kv_slots[rows], prefix_lens, waiting)
        return self._write(meta.kv_slots, meta.seq_lens, ext)

    def _write(self, prefix: torch.Tensor, prefix_lens: torch.Tensor, ext: DraftExtendInput) -> DraftInput:
        """One draft forward over `ext`'s tokens (each request's after its committed slots, prefix
        (B, L) valid up to prefix_lens (B,)): their KV, and each request's next DraftInput from its
        last row."""
        rows = PassRows(tokens=ext.next_tokens if self.shifted else ext.tokens, positions=ext.positions,
                        prefix=prefix, prefix_lens=prefix_lens, slots=ext.slots, new_lens=ext.extend_lens)
        recurrent, head = self._forward(rows, ext.hidden_states, True)
        last = _last_rows(ext)
        verified = ext.next_tokens[last]
        if not self.shifted:
            empty = torch.zeros((ext.num_requests, 0))
            return DraftInput(verified, None, empty, empty.long())
        probs, ids = self.model.topk(head[last.to(self.device)], self.topk)
        out = DraftInput(verified, recurrent[last.to(self.device)].cpu(), probs.cpu(), ids.cpu())
        self.hidden_spec.check(out.hidden_states, "draft.extend output")
        return out

    # ---- staying ready cheaply: plain steps defer the draft's extend ----------------------------
    # A plain step drafts nothing, and the next one may not either (the scheduler chose plain
    # decoding because drafts did not pay): extending the draft there would cost a draft forward
    # per token that no tree may use. The same holds for a prompt that joins such a load (the
    # scheduler marks its chunks `defer_draft`). Each such token's extend input (token, next token,
    # position, target hidden row, and how many waiting tokens its request's slots end in with it)
    # waits here under its KV slot; they are always the tail of their request's committed slots.
    # When the request is next drafted for, one prefill-shaped forward catches its draft KV up over
    # all of them (`_catch_up`); a request with `max_pending` waiting tokens is caught up at once,
    # which bounds the memory they hold. The tree-size policy counts the same waiting tokens
    # (`TreeSizePolicy.lag`) and charges their catch-up to the tree that resumes.
    max_pending = MAX_DRAFT_LAG

    def _runs(self, meta: BatchMeta) -> list[int]:
        """(B,) waiting tokens each request's committed slots end in, as its last slot counts them
        (`_waiting_tail` checks them)."""
        batch = meta.num_requests
        if not self._pending or meta.kv_slots.shape[1] == 0:
            return [0] * batch
        last = meta.kv_slots.gather(1, (meta.seq_lens - 1).clamp(min=0).unsqueeze(1)).squeeze(1).tolist()
        return [self._pending[slot][4] if n > 0 and slot in self._pending else 0
                for slot, n in zip(last, meta.seq_lens.tolist())]

    def _waiting_tail(self, slots: torch.Tensor, seq_len: int, run: int) -> list[int]:
        """The waiting tail of a request's committed `slots` (its first `seq_len`), at most `run` long:
        the slots still waiting from its end (a slot reused by another request since is not)."""
        tail = slots[seq_len - run: seq_len].tolist()
        waiting = 0
        for slot in reversed(tail):
            if slot not in self._pending:
                break
            waiting += 1
        return tail[len(tail) - waiting:]

    def _catch_up(self, prefix: torch.Tensor, prefix_lens: list[int], waiting: list[list[int]]) -> DraftInput:
        """Extend the draft over each request's waiting tokens (`waiting[i]` after the first
        `prefix_lens[i]` of its committed slots `prefix[i]`, (R, L)) in one forward; returns those
        requests' DraftInput rows. Requests that hit one cached prefix share its slots, and may share
        waiting ones there: each row extends over its own copy of them (the same token, position and
        target hidden row write the same draft KV), and they stop waiting once all have run. Timed:
        the tree-size policy prices catch-ups from these forwards (`_spent`)."""
        start = time.perf_counter()
        entries = [self._pending[slot] for slots in waiting for slot in slots]
        for slots in waiting:
            for slot in slots:
                self._pending.pop(slot, None)
        hidden = None if self.input_spec is None else torch.stack([e[3] for e in entries])
        long = lambda i: torch.tensor([e[i] for e in entries], dtype=torch.long)  # noqa: E731
        ext = DraftExtendInput(
            tokens=long(0), next_tokens=long(1), positions=long(2),
            slots=torch.tensor([slot for slots in waiting for slot in slots], dtype=torch.long),
            hidden_states=hidden, extend_lens=torch.tensor([len(w) for w in waiting], dtype=torch.long),
            accept_lens=torch.zeros(len(waiting), dtype=torch.long),
        )
        out = self._write(prefix, torch.tensor(prefix_lens, dtype=torch.long), ext)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tokens, seconds = self._spent
        self._spent = (tokens + len(entries), seconds + time.perf_counter() - start)
        return out

    def _waiting(self, meta: BatchMeta) -> tuple[list[int], list[int], list[list[int]]]:
        """The rows of `meta` whose committed slots end in waiting tokens: each one's count of
        committed slots before them, and the waiting slots."""
        rows, prefix_lens, waiting = [], [], []
        for b, (seq_len, run) in enumerate(zip(meta.seq_lens.tolist(), self._runs(meta))):
            tail = self._waiting_tail(meta.kv_slots[b], seq_len, run) if run else []
            if tail:
                rows.append(b)
                prefix_lens.append(seq_len - len(tail))
                waiting.append(tail)
        return rows, prefix_lens, waiting

    def _caught_up(self, meta: BatchMeta, draft_input: DraftInput) -> DraftInput:
        """`draft_input` with every request that has waiting tokens caught up (its placeholder row,
        see `_defer`, replaced by the real one)."""
        rows, prefix_lens, waiting = self._waiting(meta)
        if not rows:
            return draft_input
        return _with_rows(draft_input, rows, self._catch_up(meta.kv_slots[rows], prefix_lens, waiting))

    def _defer(self, meta: BatchMeta, ext: DraftExtendInput) -> DraftInput:
        """A plain step's extend, or a deferred prompt chunk's: keep the committed tokens' inputs for a
        later catch-up; returns placeholder rows (the verified ids only) for requests still waiting."""
        slots, tokens, nxt, pos = (t.tolist() for t in (ext.slots, ext.tokens, ext.next_tokens, ext.positions))
        lens, seq_lens, runs = ext.extend_lens.tolist(), meta.seq_lens.tolist(), self._runs(meta)
        start, full = 0, []
        for b, n in enumerate(lens):
            # One copy per request (the step's buffers are reused); its rows are views of it.
            hidden = None if ext.hidden_states is None else ext.hidden_states[start: start + n].clone()
            for j in range(n):
                self._pending[slots[start + j]] = (tokens[start + j], nxt[start + j], pos[start + j],
                                                   None if hidden is None else hidden[j], runs[b] + j + 1)
            if runs[b] + n >= self.max_pending:
                full.append(b)
            start += n
        new = torch.split(ext.slots, lens)
        if len(self._pending) > sum(runs) + sum(lens) + 8 * self.max_pending:
            # Leftovers of requests that ended while waiting (a request outside this step would
            # lose its wait too: its draft then proposes from stale KV, which only costs acceptance).
            keep = {slot for b, s in enumerate(seq_lens)
                    for slot in self._waiting_tail(meta.kv_slots[b], s, runs[b]) + new[b].tolist()}
            self._pending = {k: v for k, v in self._pending.items() if k in keep}
        out = placeholder_draft_input(ext.next_tokens[_last_rows(ext)], self.hidden_spec,
                                      self.topk if self.shifted else 0)
        if not full:
            return out
        tails = [self._waiting_tail(meta.kv_slots[b], seq_lens[b], runs[b]) + new[b].tolist() for b in full]
        prefix_lens = [seq_lens[b] - (len(tail) - lens[b]) for b, tail in zip(full, tails)]
        return _with_rows(out, full, self._catch_up(meta.kv_slots[full], prefix_lens, tails))

    @torch.inference_mode()
    def propose(self, meta: BatchMeta, draft_input: DraftInput) -> VerifyInput:
        """EAGLE-2 style dynamic tree: expand the `topk` best beams for `num_steps` levels,
        then keep the `tree_size - 1` candidates with the highest path probability; with
        `ngram_branch`, a prompt-lookup match is kept first (`with_branches`). The step's verify
        width (`step_nodes`, the scheduler's choice) cuts the tree to fewer nodes, and its depth
        with it (1: the root alone, no draft forward); `min_path_prob` cuts it to the candidates
        at least that likely (`confident_nodes`) and stops the levels there. Requests whose draft
        waits behind plain steps are caught up first (`_caught_up`)."""
        batch, k = draft_input.num_requests, self.topk
        if batch == 0:
            return VerifyInput.create_idle(self.tree_size)
        meta = meta.decode_part()  # a mixed step's prefill rows have nothing to draft
        nodes = step_nodes(meta, self.tree_size)
        if nodes == 1:
            return root_only(meta, draft_input)
        draft_input = self._caught_up(meta, draft_input)
        if self.hidden_spec is not None:
            self.hidden_spec.check(draft_input.hidden_states, "draft.propose input")
        seq_lens, committed = meta.seq_lens, meta.kv_slots  # committed (B, L) valid up to seq_lens
        scratch = meta.scratch_slots
        used = 0
        lineage = torch.zeros((batch, 0), dtype=torch.long)  # (B, depth) scratch slots of a beam's ancestors
        if draft_input.topk_index.shape[1] == 0:
            # STANDALONE: the root is not in the draft's KV yet; consume it to get the first top-k.
            root = PassRows(tokens=draft_input.verified_id, positions=seq_lens, prefix=committed, prefix_lens=seq_lens,
                            slots=scratch[:, 0], new_lens=torch.ones(batch, dtype=torch.long))
            _, head = self._forward(root, None, False)
            scores, tokens = (t.cpu() for t in self.model.topk(head, k))
            lineage, used, hidden = scratch[:, :1], 1, None
        else:
            scores, tokens, hidden = draft_input.topk_p, draft_input.topk_index, draft_input.hidden_states
        # The candidate pool, in creation order so that parents precede children.
        pool_scores, pool_tokens = [scores], [tokens]
        pool_parents = [torch.full((batch, k), -1, dtype=torch.long)]
        beam_pool = torch.arange(k).expand(batch, k)  # (B, K) pool index of each beam
        beam_scores, beam_tokens = scores, tokens
        beam_lineage = lineage.unsqueeze(1).expand(batch, k, lineage.shape[1])  # (B, K, d)
        beam_hidden = None if hidden is None else hidden.unsqueeze(1).expand(batch, k, hidden.shape[1])
        pool_size = k
        for depth in range(1, min(self.num_steps, nodes - 1)):  # no level deeper than a kept node can be
            if self.min_path_prob and float(beam_scores.max()) < self.min_path_prob:
                break  # a child's path probability is at most its beam's: no deeper candidate would be kept
            slots = scratch[:, used : used + k]  # (B, K)
            used += k
            # EAGLE pairs the depth-d token with its parent's hidden at position L + d - 1.
            positions = (seq_lens + depth - (1 if self.shifted else 0)).repeat_interleave(k)
            level = PassRows(tokens=beam_tokens.reshape(-1), positions=positions,
                             prefix=_beam_prefix(committed, seq_lens, beam_lineage),
                             prefix_lens=(seq_lens + beam_lineage.shape[2]).repeat_interleave(k),
                             slots=slots.reshape(-1), new_lens=torch.ones(batch * k, dtype=torch.long))
            recurrent, head = self._forward(
                level, None if beam_hidden is None else beam_hidden.reshape(batch * k, -1), False)
            probs, ids = (t.cpu() for t in self.model.topk(head, k))  # (B*K, K)
            cand_scores = (beam_scores.unsqueeze(2) * probs.view(batch, k, k)).reshape(batch, k * k)
            cand_tokens = ids.view(batch, k * k)
            pool_scores.append(cand_scores)
            pool_tokens.append(cand_tokens)
            pool_parents.append(beam_pool.unsqueeze(2).expand(batch, k, k).reshape(batch, k * k))
            best = cand_scores.topk(k, dim=1).indices  # (B, K)
            parent_beam = best // k
            beam_pool = pool_size + best
            pool_size += k * k
            beam_scores, beam_tokens = cand_scores.gather(1, best), cand_tokens.gather(1, best)
            beam_lineage = torch.cat(
                [beam_lineage.gather(1, parent_beam.unsqueeze(2).expand(-1, -1, beam_lineage.shape[2])),
                 slots.gather(1, parent_beam).unsqueeze(2)], dim=2,
            )
            if recurrent is not None:
                rec = recurrent.cpu().view(batch, k, -1)
                beam_hidden = rec.gather(1, parent_beam.unsqueeze(2).expand(-1, -1, rec.shape[2]))
        pool = torch.cat(pool_scores, 1), torch.cat(pool_tokens, 1), torch.cat(pool_parents, 1)
        if self.ngram_branch:
            branches = [prompt_lookup(h, self.ngram_branch, min_ngram=NGRAM_BRANCH_MIN) for h in _histories(meta)]
            pool = with_branches(*pool, branches)
        if self.min_path_prob:
            nodes = min(nodes, confident_nodes(pool[0], self.min_path_prob))
        return select_tree(draft_input.verified_id, seq_lens, *pool, nodes)


def _beam_prefix(committed: torch.Tensor, seq_lens: torch.Tensor, lineage: torch.Tensor) -> torch.Tensor:
    """Each beam's keys before its new token: its request's committed slots (B, L), valid up to
    seq_lens (B,), then its ancestors' scratch slots lineage (B, K, d) -> (B * K, L + d), valid up
    to seq_lens + d."""
    batch, k, d = lineage.shape
    out = torch.nn.functional.pad(committed, (0, d)).repeat_interleave(k, 0)  # (B * K, L + d)
    cols = (seq_lens.repeat_interleave(k).unsqueeze(1) + torch.arange(d))  # (B * K, d)
    return out.scatter_(1, cols, lineage.reshape(batch * k, d))


def _with_rows(base: DraftInput, rows: list[int], new: DraftInput) -> DraftInput:
    """`base` with its `rows` replaced by `new`'s rows (in order)."""
    index = torch.tensor(rows, dtype=torch.long)
    out = DraftInput(*(None if t is None else t.clone() for t in
                       (base.verified_id, base.hidden_states, base.topk_p, base.topk_index)))
    for name in ("verified_id", "hidden_states", "topk_p", "topk_index"):
        if getattr(out, name) is not None:
            getattr(out, name)[index] = getattr(new, name).to(getattr(out, name).dtype)
    return out


def confident_nodes(scores: torch.Tensor, min_path_prob: float) -> int:
    """Tree size (root included) that keeps every candidate of `scores` (B, P) scoring at least
    `min_path_prob`, for the request with the most such; the batch verifies one width, so the
    others fill theirs with their next best. 1 (the root alone, a plain decode step) when the
    draft is unsure of every candidate: verifying rows it would likely reject costs more than
    they save (a 4-token verify costs ~1.3 one-token steps on a 2-core CPU, `bench.runner`)."""
    return 1 + int((scores >= min_path_prob).sum(dim=1).max())


def select_tree(root: torch.Tensor, seq_lens: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor,
                parents: torch.Tensor, tree_size: int) -> VerifyInput:
    """Keep the tree_size - 1 best candidates of each request's pool (scores/tokens/parents
    (B, P), parents as pool indices, -1 under the root), as nodes 1.. in that rank order. A
    child's score never exceeds its parent's, a parent precedes its children in the pool, and a
    stable sort breaks ties by pool order, so the kept set contains every kept node's parent and
    parents come first. Ranked nodes make every smaller tree a prefix: the tree of the n best is
    nodes 0..n-1, so a verified tree tells what each smaller one would have accepted
    (`DraftExtendInput.accepted_nodes`)."""
    batch = root.shape[0]
    kept = torch.sort(-scores, dim=1, stable=True).indices[:, : tree_size - 1]  # (B, N-1) pool indices, best first
    node_of_pool = torch.zeros_like(scores, dtype=torch.long)
    node_of_pool.scatter_(1, kept, torch.arange(1, tree_size).expand(batch, -1))
    pool_parent = parents.gather(1, kept)
    node_parent = torch.where(pool_parent >= 0, node_of_pool.gather(1, pool_parent.clamp_min(0)), 0)
    tree_parents = torch.cat([torch.full((batch, 1), -1, dtype=torch.long), node_parent], dim=1)
    return _verify_input(root, tokens.gather(1, kept), tree_parents, seq_lens)
