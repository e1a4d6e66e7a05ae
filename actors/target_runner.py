"""TargetRunner: owns the target model and its KV pool; runs prefill and verification.

Acceptance happens here so logits never leave this process: it returns only committed
tokens, accept lengths and the hidden rows the draft needs (a DraftExtendInput).
"""

from __future__ import annotations

import logging

import torch

from actors.cuda_graphs import StepGraphs, pool_slots
from actors.device import parse_dtype, pick_device, set_threads
from actors.pass_rows import PassRows, ragged_rows
from models.attention import AttentionMetadata
from models.build import ModelSource, build_target
from models.compiled import CompiledDecoder, compiles
from models.cpu_kernels import use_attention_kernel
from models.packed import pack_linears
from spec.algorithm import SpecAlgorithm
from spec.batch import BatchMeta, DraftExtendInput, VerifyInput
from spec.sampling import (accept_tree, choose_tokens, needs_processors, prefill_processor_rows, token_logprobs,
                           tree_processor_rows)
from spec.shapes import get_draft_input_hidden_state_spec, get_target_aux_layer_ids, uses_aux_hidden_states

log = logging.getLogger(__name__)


class TargetRunner:
    def __init__(
        self,
        model: str,
        algorithm: SpecAlgorithm | str | None = None,
        draft_model: str | None = None,
        num_slots: int = 16384,
        dtype: str | torch.dtype = "float32",
        device: str = "auto",
        num_threads: int | None = None,
        cuda_graphs: bool = True,
        torch_compile: bool = False,
    ):
        set_threads(num_threads)
        self.algorithm = SpecAlgorithm.from_name(algorithm)
        self.device = pick_device(device)
        self.dtype = parse_dtype(dtype, self.device)
        self.source = ModelSource.resolve(model)
        draft_config = ModelSource.resolve(draft_model).config if draft_model else None
        self.model = build_target(self.source, self.dtype, self.device)
        pack_linears(self.model, self.dtype, self.device)
        self.kv = self.model.make_kv_pool(pool_slots(num_slots), self.dtype, self.device)
        self.num_slots = num_slots
        self.graphs: StepGraphs | None = None  # decode / verify passes through CUDA graphs
        if cuda_graphs and self.device.type == "cuda":
            self.use_step_graphs(capture=True)
        # What the draft consumes: EAGLE3 the concatenated inputs of the aux layers, EAGLE the
        # final hidden state; others nothing. The width is the spec's, checked on the way out.
        self.out_spec = get_draft_input_hidden_state_spec(self.algorithm, self.source.config, draft_config, self.dtype)
        use_aux = self.algorithm is SpecAlgorithm.EAGLE3 and uses_aux_hidden_states(draft_config)
        self.aux_layer_ids = get_target_aux_layer_ids(self.source.config, draft_config) if use_aux else None
        # On CPU: attention through our C++ kernel (models.cpu_kernels), and small passes through the
        # compiled decoder (models.compiled), both built here, at load.
        self.compiled: CompiledDecoder | None = None
        self.attention_kernel = torch_compile and use_attention_kernel(self.model, self.dtype, self.device)
        if torch_compile and compiles(self.dtype, self.device):
            try:
                self.compiled = CompiledDecoder(self.model)
                self.compiled.warm_up(self.kv, self.aux_layer_ids, dump_slot=self.num_slots)
            except Exception as exc:  # a model inductor cannot compile still serves, eagerly
                log.warning("torch_compile: compiling %s failed, running it eagerly: %s", model, exc)
                self.compiled = None

    @torch.inference_mode()
    def forward_step(self, meta: BatchMeta, verify: VerifyInput) -> DraftExtendInput:
        """One target pass over the step's rows: the running requests' verify trees (`verify`, the
        first rows of `meta`) and the prompt chunks after them (see BatchMeta.num_decode). A mixed
        step runs both in one forward, so the chunks cost the running requests no extra step."""
        if meta.num_requests == 0:
            return DraftExtendInput.create_idle(self.out_spec)
        if not meta.is_prefill:
            return self.verify(meta, verify)
        if meta.num_decode == 0:
            return self.prefill(meta)
        decode, prefill = meta.decode_part(), meta.prefill_part()
        v_in, p_in = self._verify_inputs(decode, verify), self._prefill_inputs(prefill)
        hidden, aux = self._run(v_in.then(p_in))
        rows = v_in.num_tokens  # verify rows first, then the chunks' rows
        (h_v, h_p), (a_v, a_p) = _split_rows(hidden, rows), _split_rows(aux, rows)
        # One lm_head pass for the tree rows and the chunks' last rows: its weights are read once (a
        # second pass for one prompt's row cost 4 ms of a 31-request fp32 step).
        last = self._last_rows(prefill)
        logits = self.model.logits(torch.cat([h_v, h_p[last.to(self.device)]]))  # (B * N + Bp, V)
        return self._verified(decode, verify, h_v, a_v, logits[:rows]).merge(
            self._prefilled(prefill, p_in, h_p, a_p, logits[rows:]))

    def use_step_graphs(self, capture: bool) -> None:
        """Run verify passes through `StepGraphs` (captured when `capture` and on CUDA, else the
        same padded static-buffer pass eagerly: how the CPU tests check it)."""
        self.graphs = StepGraphs(self._forward, self.device, dump_slot=self.num_slots, capture=capture)

    def _forward(self, tokens: torch.Tensor, _hidden, attn: AttentionMetadata):
        if self.compiled is not None and self.compiled.takes(tokens, attn):
            return self.compiled(tokens, attn, self.kv)
        return self.model(tokens, attn, self.kv, self.aux_layer_ids)

    def _run(self, rows: PassRows, graphed: bool = False):
        """(hidden (T, H), aux (T, A) or None) of one forward over `rows`; `graphed`: through the
        step graphs when they hold its shape (a decode / verify pass)."""
        out = self.graphs.run(rows) if graphed and self.graphs is not None else None
        return out if out is not None else self._forward(rows.tokens.to(self.device), None, rows.metadata(self.device))

    @staticmethod
    def _choose(logits: torch.Tensor, *per_row: torch.Tensor, processors=None) -> torch.Tensor:
        """choose_tokens on the logits' device; only the (R,) token ids come back to the host, not
        the (R, V) logits (25 MB a step at 256 requests, copied and argmaxed on the CPU before)."""
        return choose_tokens(logits, *(t.to(logits.device) for t in per_row), processors=processors).cpu()

    @staticmethod
    def _logprobs(meta: BatchMeta, logits: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """DraftExtendInput's logprob fields for rows whose next tokens are `tokens` (R,) and whose
        logits are `logits` (R, V); empty ({}: the defaults) when no request asked."""
        if not bool((meta.num_logprobs >= 0).any()):
            return {}
        lp, top, ids = token_logprobs(logits, tokens, int(meta.num_logprobs.max()))
        return dict(logprobs=lp, top_logprobs=top, top_ids=ids)

    def _draft_rows(self, hidden, aux, rows):
        if self.out_spec is None:
            return None
        out = (aux if aux is not None else hidden)[rows].cpu()
        self.out_spec.check(out, "target -> draft hidden states")
        return out

    def prefill(self, meta: BatchMeta) -> DraftExtendInput:
        inputs = self._prefill_inputs(meta)
        return self._prefilled(meta, inputs, *self._run(inputs))

    @staticmethod
    def _prefill_inputs(meta: BatchMeta) -> PassRows:
        """The chunks of `meta` (prefill rows only), each after its committed slots, causal."""
        lens, width = meta.prefill_lens, meta.prefill_tokens.shape[1]
        positions = meta.seq_lens.unsqueeze(1) + torch.arange(width)  # (B, P)
        return PassRows(tokens=ragged_rows(meta.prefill_tokens, lens), positions=ragged_rows(positions, lens),
                        prefix=meta.kv_slots, prefix_lens=meta.seq_lens,
                        slots=ragged_rows(meta.prefill_slots, lens), new_lens=lens)

    @staticmethod
    def _last_rows(meta: BatchMeta) -> torch.Tensor:
        """(B,) each chunk's last row among the chunks' rows: the one whose next token is sampled."""
        return meta.prefill_lens.cumsum(0) - 1

    def _prefilled(self, meta: BatchMeta, inputs: PassRows, hidden, aux,
                   logits: torch.Tensor | None = None) -> DraftExtendInput:
        """The chunks' DraftExtendInput from their hidden rows (T, H) (and aux rows); `logits`: those of
        each chunk's last row (B, V), if already computed."""
        tokens, positions = inputs.tokens, inputs.positions
        lens = meta.prefill_lens.tolist()
        last = self._last_rows(meta)
        if logits is None:
            logits = self.model.logits(hidden[last.to(self.device)])  # (B, V)
        sampled = self._choose(logits, meta.temperature, meta.top_p, meta.top_k, meta.seeds,
                               meta.seq_lens + meta.prefill_lens, meta.min_p,
                               processors=prefill_processor_rows(meta) if needs_processors(meta) else None)
        chosen = torch.where(meta.next_token >= 0, meta.next_token, sampled)
        next_tokens = tokens.clone()
        next_tokens[:-1] = tokens[1:]
        next_tokens[last] = chosen
        logprobs = self._logprobs(meta, logits, chosen)
        if logprobs:  # only each request's last row carries a new token
            rows = tokens.numel()
            full = dict(logprobs=torch.zeros(rows), top_logprobs=torch.zeros((rows, logprobs["top_ids"].shape[1])),
                        top_ids=torch.zeros((rows, logprobs["top_ids"].shape[1]), dtype=torch.long))
            for name, value in logprobs.items():
                full[name][last] = value
            logprobs = full
        return DraftExtendInput(
            tokens=tokens, next_tokens=next_tokens, positions=positions, slots=inputs.slots,
            hidden_states=self._draft_rows(hidden, aux, torch.arange(tokens.numel(), device=self.device)),
            extend_lens=meta.prefill_lens.clone(), accept_lens=torch.zeros(len(lens), dtype=torch.long),
            **logprobs,
        )

    def verify(self, meta: BatchMeta, verify: VerifyInput) -> DraftExtendInput:
        return self._verified(meta, verify, *self._run(self._verify_inputs(meta, verify), graphed=True))

    @staticmethod
    def _verify_inputs(meta: BatchMeta, verify: VerifyInput) -> PassRows:
        """The trees of `meta` (decode rows only): B * N tokens after each request's committed
        slots, in its N verify slots, under its (N, N) tree mask."""
        batch, n = verify.draft_tokens.shape
        return PassRows(tokens=verify.draft_tokens.reshape(-1), positions=verify.positions.reshape(-1),
                        prefix=meta.kv_slots, prefix_lens=meta.seq_lens,
                        slots=meta.verify_slots[:, :n].reshape(-1), new_lens=torch.full((batch,), n),
                        trees=verify.tree_mask)

    def _verified(self, meta: BatchMeta, verify: VerifyInput, hidden, aux,
                  logits: torch.Tensor | None = None) -> DraftExtendInput:
        """Accept each tree's longest agreeing path from the trees' hidden rows (B * N, H) (`logits`:
        theirs, if already computed)."""
        batch, n = verify.draft_tokens.shape
        slots = meta.verify_slots[:, :n]
        if logits is None:
            logits = self.model.logits(hidden)  # (B * N, V): every node needs the target's choice
        per_row = lambda x: x.repeat_interleave(n)  # noqa: E731
        processors = (tree_processor_rows(meta, verify.draft_tokens, verify.tree_mask, verify.positions)
                      if needs_processors(meta) else None)
        target_tokens = self._choose(
            logits, per_row(meta.temperature), per_row(meta.top_p), per_row(meta.top_k), per_row(meta.seeds),
            verify.positions.reshape(-1) + 1, per_row(meta.min_p), processors=processors,
        ).view(batch, n)
        rows, next_tokens, accept_lens, paths = [], [], [], []
        for b in range(batch):
            path, bonus = accept_tree(verify.draft_tokens[b].tolist(), verify.parents[b].tolist(), target_tokens[b].tolist())
            paths.append(path)
            rows.extend(b * n + node for node in path)
            next_tokens.extend(verify.draft_tokens[b, path[1:]].tolist() + [bonus])
            accept_lens.append(len(path) - 1)
        rows_t = torch.tensor(rows, dtype=torch.long)
        next_t = torch.tensor(next_tokens, dtype=torch.long)
        most = max(accept_lens, default=0)
        return DraftExtendInput(
            tokens=verify.draft_tokens.reshape(-1)[rows_t],
            next_tokens=next_t,
            positions=verify.positions.reshape(-1)[rows_t],
            slots=slots.reshape(-1)[rows_t],
            hidden_states=self._draft_rows(hidden, aux, rows_t.to(self.device)),
            extend_lens=torch.tensor(accept_lens, dtype=torch.long) + 1,
            accept_lens=torch.tensor(accept_lens, dtype=torch.long),
            **self._logprobs(meta, logits[rows_t.to(logits.device)], next_t),
            tree_nodes=torch.full((batch,), n, dtype=torch.long),
            # A node's depth is its position past the root's (positions (B, N), the root's first).
            tree_depths=(verify.positions.max(dim=1).values - verify.positions[:, 0]).cpu(),
            accepted_nodes=torch.tensor([path[1:] + [-1] * (most - len(path) + 1) for path in paths],
                                        dtype=torch.long).view(batch, most),
        )


def _split_rows(x: torch.Tensor | None, rows: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(first `rows` rows, the rest) of x, or (None, None)."""
    return (None, None) if x is None else (x[:rows], x[rows:])
