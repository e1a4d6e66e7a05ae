"""Model code against transformers on the same weights, checkpoint loading, and the runners.

Our target (paged KV, flat ragged rows, explicit positions, tree masks) is compared with
transformers' Llama / Mistral / Qwen2 / Qwen3 ForCausalLM logits in fp32 for prefill, decode after
prefill, tree verification and a ragged batch; every KV pool starts full of large garbage so
that reading a slot a request does not own (or a padding slot) changes the result. Tiny
random models go through the real loader; the real SmolLM2 tests are marked integration and
share one module-scoped load.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from bench.random_models import make_eagle, make_eagle3, make_llama

from models import attention
from models.attention import AttentionMetadata, KVPool, grouped_attention, grouped_pays, masked_attention
from models.build import ModelSource, build_draft, build_target, check_target
from models.loader import CheckpointError, resolve_model
from models.packed import PackedLinear, can_pack, pack_linears, product_dtype
from models.registry import DEFAULT_MODEL, REGISTRY
from spec import BatchMeta, DraftExtendInput, ShapeContractError, SpecAlgorithm, VerifyInput
from spec.tree import ancestor_mask, depths

FP32 = torch.float32
# Dtypes the runners pack on this CPU (fp32 and bf16 wherever oneDNN is: bf16 natively or widened to fp32).
PACKED_DTYPES = [d for d in (torch.float32, torch.bfloat16) if can_pack(d, "cpu")]
needs_packing = pytest.mark.skipif(not PACKED_DTYPES, reason="oneDNN linear ops unavailable")
ATOL = 1e-4  # fp32 logits, ours vs transformers
NUM_SLOTS = 256
GARBAGE = 1e3  # magnitude of the values that fill slots a request must never read

# --------------------------------------------------------------------------- tiny models


def _randomize_vectors(folder: Path, seed: int) -> None:
    """Give biases and norm weights random values (save_pretrained leaves them 0 / 1), so a
    bias or norm that is not loaded, or loaded into the wrong place, shows in the logits."""
    path = folder / "model.safetensors"
    state = load_file(str(path))
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith(".bias"):
            state[name] = torch.randn(t.shape, generator=g) * 0.2
        elif name.endswith("norm.weight"):
            state[name] = 1.0 + torch.randn(t.shape, generator=g) * 0.2
    save_file(state, str(path), metadata={"format": "pt"})


def _make_qwen2(folder: Path, seed: int = 7) -> Path:
    """Qwen2: q/k/v biases (no o_proj bias), untied, YaRN RoPE (attention scaling != 1)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=512, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=62, pad_token_id=None,
    )
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.25 if p.dim() == 2 else 1.0 + torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    _randomize_vectors(folder, seed)
    return folder


def _make_variant(name: str, folder: Path) -> Path:
    if name == "llama_untied_bias_linear_rope":
        make_llama(folder, tie=False, layers=5, seed=3, attention_bias=True, mlp_bias=True,
                   rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    elif name == "llama_head_dim_mqa_llama3_rope":
        # head_dim 32 != hidden / heads, a single KV head, Llama-3 frequency-dependent RoPE scaling.
        make_llama(folder, layers=6, heads=4, kv_heads=1, seed=4, head_dim=32,
                   rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                    "rope_theta": 500000.0})
    elif name == "qwen2_yarn_rope":
        return _make_qwen2(folder)
    elif name == "qwen3_qk_norm":
        # Per-head q/k RMSNorm, head_dim 24 != hidden / heads, untied; sliding window switched off
        # (use_sliding_window false) as published Qwen3 configs have it.
        make_llama(folder, arch="qwen3", layers=5, heads=4, kv_heads=2, head_dim=24, tie=False, seed=8,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                   sliding_window=None, use_sliding_window=False, max_window_layers=5)
    elif name == "mistral":
        # Mistral v0.3: no sliding window, head_dim given, untied.
        make_llama(folder, arch="mistral", layers=4, heads=4, kv_heads=1, head_dim=16, tie=False, seed=9,
                   sliding_window=None)
    else:
        raise KeyError(name)
    _randomize_vectors(folder, seed=11)
    return folder


CONFIGS = ["tied_gqa", "llama_untied_bias_linear_rope", "llama_head_dim_mqa_llama3_rope", "qwen2_yarn_rope",
           "qwen3_qk_norm", "mistral"]


@dataclass
class Pair:
    """Our model and transformers' on the same folder."""

    folder: Path
    ours: torch.nn.Module
    hf: torch.nn.Module

    @property
    def num_layers(self) -> int:
        return self.ours.shape.num_layers


def _load_pair(folder: Path) -> Pair:
    from transformers import AutoModelForCausalLM

    ours = build_target(ModelSource.resolve(folder), FP32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=FP32).eval()
    return Pair(Path(folder), ours, hf)


@pytest.fixture(scope="module", params=CONFIGS)
def pair(request, tiny_target, tmp_path_factory) -> Pair:
    if request.param == "tied_gqa":
        return _load_pair(tiny_target)
    return _load_pair(_make_variant(request.param, tmp_path_factory.mktemp(request.param)))


# --------------------------------------------------------------------------- helpers


class Slots:
    """Shuffled, non-contiguous slot ids; slot 0 (where padded keys point) is never handed out."""

    def __init__(self, seed: int, num_slots: int = NUM_SLOTS):
        g = torch.Generator().manual_seed(seed)
        self._ids = (torch.randperm(num_slots - 1, generator=g) + 1).tolist()

    def take(self, n: int) -> torch.Tensor:
        out, self._ids = self._ids[:n], self._ids[n:]
        return torch.tensor(out, dtype=torch.long)


def garbage_pool(model, seed: int, num_slots: int = NUM_SLOTS) -> KVPool:
    kv = model.make_kv_pool(num_slots, FP32, "cpu")
    g = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g) * GARBAGE)
    return kv


def snapshot(kv: KVPool) -> list[torch.Tensor]:
    return [t.clone() for t in kv.k + kv.v]


@dataclass
class Req:
    """One request's part of a forward pass."""

    tokens: list[int]
    slots: torch.Tensor
    positions: torch.Tensor
    prefix_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    prefix_tokens: list[int] = field(default_factory=list)
    mask: torch.Tensor | None = None  # (n, n) bool, None = causal

    @property
    def attend(self) -> torch.Tensor:
        n = len(self.tokens)
        return torch.ones(n, n, dtype=torch.bool).tril() if self.mask is None else self.mask


def prefill_req(tokens: list[int], slots: Slots, prefix: Req | None = None) -> Req:
    """Causal new tokens, after `prefix`'s committed context (a chunked prefill) if given."""
    ptoks = [] if prefix is None else prefix.prefix_tokens + prefix.tokens
    pslots = torch.zeros(0, dtype=torch.long) if prefix is None else torch.cat([prefix.prefix_slots, prefix.slots])
    start = len(ptoks)
    return Req(tokens, slots.take(len(tokens)), torch.arange(start, start + len(tokens)), pslots, ptoks)


def tree_req(prefix: Req, tokens: list[int], parents: list[int], slots: Slots) -> Req:
    """A draft tree after `prefix` (already in the KV pool): tree mask and explicit positions."""
    mask = ancestor_mask(torch.tensor([parents]))
    start = len(prefix.prefix_tokens) + len(prefix.tokens)
    return Req(tokens, slots.take(len(tokens)), start + depths(mask)[0],
               torch.cat([prefix.prefix_slots, prefix.slots]), prefix.prefix_tokens + prefix.tokens, mask[0])


@torch.no_grad()
def ours_forward(model, kv: KVPool, reqs: list[Req], aux_layer_ids=None):
    """One forward pass over all requests -> (per-request logits, per-request aux or None)."""
    meta = AttentionMetadata.build(
        [r.prefix_slots for r in reqs], [r.slots for r in reqs], torch.cat([r.positions for r in reqs]),
        [r.mask for r in reqs],
    )
    ids = torch.tensor([t for r in reqs for t in r.tokens], dtype=torch.long)
    hidden, aux = model(ids, meta, kv, aux_layer_ids)
    lens = [len(r.tokens) for r in reqs]
    logits = list(model.logits(hidden).split(lens))
    return logits, (None if aux is None else list(aux.split(lens)))


@torch.no_grad()
def hf_run(hf, ids: list[int]):
    return hf(torch.tensor([ids]), output_hidden_states=True)


@torch.no_grad()
def hf_expected(hf, req: Req) -> torch.Tensor:
    """(n, V) what transformers gives each new token: the prefix, then the tokens it may attend
    to (its ancestors and itself, in node order), as one ordinary causal sequence."""
    if req.mask is None:
        return hf_run(hf, req.prefix_tokens + req.tokens).logits[0, -len(req.tokens):]
    n = len(req.tokens)
    rows: list[torch.Tensor | None] = [None] * n
    for i in reversed(range(n)):  # one forward per branch (leaf) covers every node on its path
        if rows[i] is None:
            path = req.attend[i].nonzero().flatten().tolist()
            logits = hf_run(hf, req.prefix_tokens + [req.tokens[j] for j in path]).logits[0, -len(path):]
            for j, row in zip(path, logits):
                rows[j] = row
    return torch.stack(rows)


def assert_close(actual, expected, atol=ATOL, what=""):
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"{what}: max abs difference {diff:.3g} > {atol:g}"


def rand_tokens(n: int, seed: int, vocab: int = 64) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Branches 0-1-2-3, 0-1-6, 0-4-5, 0-7: siblings at every depth, a chain of 3 under the root.
TREE_PARENTS = [-1, 0, 1, 2, 0, 4, 1, 0]


# --------------------------------------------------------------------------- 1. ours vs transformers


def test_prefill_matches_transformers(pair):
    slots, kv = Slots(seed=1), garbage_pool(pair.ours, seed=1)
    req = prefill_req(rand_tokens(13, seed=1), slots)
    (logits,), _ = ours_forward(pair.ours, kv, [req])
    assert_close(logits, hf_expected(pair.hf, req), what="prefill logits")


def test_decode_after_prefill_matches_transformers(pair):
    """Prefill in shuffled slots, then three one-token decode steps each attending the slots
    written before (non-contiguous ids prove the slot indexing)."""
    slots, kv = Slots(seed=2), garbage_pool(pair.ours, seed=2)
    req = prefill_req(rand_tokens(9, seed=2), slots)
    ours_forward(pair.ours, kv, [req])
    for step, token in enumerate(rand_tokens(3, seed=3)):
        req = prefill_req([token], slots, prefix=req)
        (logits,), _ = ours_forward(pair.ours, kv, [req])
        assert_close(logits, hf_expected(pair.hf, req), what=f"decode step {step}")


def test_tree_verify_matches_per_branch_forwards(pair):
    """All branches of a draft tree in one pass (tree mask, positions = prefix + depth) equal
    transformers run separately on prefix + each node's path."""
    slots, kv = Slots(seed=4), garbage_pool(pair.ours, seed=4)
    prefix = prefill_req(rand_tokens(10, seed=4), slots)
    ours_forward(pair.ours, kv, [prefix])
    tree = tree_req(prefix, rand_tokens(len(TREE_PARENTS), seed=5), TREE_PARENTS, slots)
    assert tree.positions.tolist() == [10, 11, 12, 13, 11, 12, 12, 11]
    (logits,), _ = ours_forward(pair.ours, kv, [tree])
    assert_close(logits, hf_expected(pair.hf, tree), what="tree verify logits")


def _ragged_batch(slots: Slots) -> tuple[list[Req], list[Req]]:
    """(prefixes to commit first, the batch): a fresh prefill, a decode, a tree verify, a
    chunked prefill continuation and another decode, with different context lengths."""
    p1 = prefill_req(rand_tokens(10, seed=21), slots)
    p2 = prefill_req(rand_tokens(6, seed=22), slots)
    p3 = prefill_req(rand_tokens(4, seed=23), slots)
    p4 = prefill_req(rand_tokens(13, seed=24), slots)
    batch = [
        prefill_req(rand_tokens(7, seed=20), slots),
        prefill_req(rand_tokens(1, seed=31), slots, prefix=p1),
        tree_req(p2, rand_tokens(5, seed=32), [-1, 0, 0, 1, 2], slots),
        prefill_req(rand_tokens(5, seed=33), slots, prefix=p3),
        prefill_req(rand_tokens(1, seed=34), slots, prefix=p4),
    ]
    return [p1, p2, p3, p4], batch


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (4, 4)])
def test_expanded_kv_heads_attend_like_native_gqa(heads, kv_heads):
    """The CUDA path of masked_attention (each query head given its KV head explicitly, so SDPA
    can use a fused kernel with a mask) equals SDPA's enable_gqa and a plain softmax reference."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, q_len, k_len, d = 3, 5, 11, 16
    q = torch.randn(b, heads, q_len, d, generator=g)
    k, v = (torch.randn(b, kv_heads, k_len, d, generator=g) for _ in range(2))
    mask = torch.rand(b, 1, q_len, k_len, generator=g) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    native = masked_attention(q, k, v, mask, 0.25, expand_kv=False)
    expanded = masked_attention(q, k, v, mask, 0.25, expand_kv=True)
    kv_of_head = torch.arange(heads) // (heads // kv_heads)
    scores = (q @ k[:, kv_of_head].transpose(-1, -2)) * 0.25
    reference = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, kv_of_head]
    torch.testing.assert_close(expanded, native, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(expanded, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["sdpa", "grouped", "widened"])
@pytest.mark.parametrize("batch,q_len", [(3, 5), (16, 2), (2, 1)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (4, 4)])
def test_bf16_cpu_attention_matches_a_softmax_reference(heads, kv_heads, batch, q_len, path, monkeypatch):
    """The bf16 CPU decode/verify attention over the pool's (B, Hkv, K, D) gather, through SDPA in bf16,
    grouped and SDPA in fp32 (each forced in turn, whatever this CPU's rules pick), equals a plain fp32
    softmax over the same bf16 inputs, to bf16 rounding (the fp32 path to one rounding of its output);
    padded-out keys holding huge values stay unread."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, k_len, d = batch, 11, 16
    q = torch.randn(b, heads, q_len, d, generator=g).bfloat16()
    k, v = (torch.randn(b, kv_heads, k_len, d, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(b, 1, q_len, k_len, generator=g) < 0.6
    mask[..., 0] = True
    k[..., -1, :], v[..., -1, :] = GARBAGE, GARBAGE
    mask[..., -1] = False
    kv_of_head = torch.arange(heads) // (heads // kv_heads)
    scores = (q.float() @ k[:, kv_of_head].float().transpose(-1, -2)) * 0.25
    reference = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, kv_of_head].float()
    monkeypatch.setattr(attention, "widened_pays", lambda *_: path == "widened")
    monkeypatch.setattr(attention, "grouped_pays", lambda *_: path == "grouped")
    calls, real = [], attention.grouped_attention
    monkeypatch.setattr(attention, "grouped_attention", lambda *args: calls.append(1) or real(*args))
    got = masked_attention(q, k, v, mask, 0.25, expand_kv=False)  # (B, Hq, Q, D)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2)
    assert len(calls) == int(path == "grouped")
    if path == "widened":
        torch.testing.assert_close(got, reference.bfloat16(), rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("without_amx", [False, True])
def test_bf16_attention_runs_grouped_where_sdpa_is_slow(without_amx, monkeypatch):
    """Without AMX, SDPA's bf16 CPU kernel is several times slower than grouped at decode shapes, so
    bf16 decode rows run grouped but over the shortest contexts; a few requests of several queries
    over a short context stay on SDPA, and so do longer queries (prefill chunks). With AMX the table's shapes hold."""
    monkeypatch.setattr(attention, "bf16_sdpa_without_amx", lambda: without_amx)
    assert grouped_pays(torch.bfloat16, 1, 1, 200) == without_amx
    assert grouped_pays(torch.bfloat16, 16, 1, 100) == without_amx
    assert not grouped_pays(torch.bfloat16, 1, 1, 60)
    assert grouped_pays(torch.bfloat16, 4, 8, 100) == without_amx
    assert grouped_pays(torch.bfloat16, 1, 8, 1000) == without_amx
    assert not grouped_pays(torch.bfloat16, 1, 8, 100)
    assert not grouped_pays(torch.bfloat16, 64, attention.GROUPED_MAX_QUERIES + 1, 100)
    assert grouped_pays(torch.bfloat16, 32, 2, 100)
    assert grouped_pays(torch.float32, 16, 1, 100) and not grouped_pays(torch.float32, 4, 1, 100)


@pytest.mark.parametrize("without_amx", [False, True])
def test_bf16_decode_rows_of_a_few_requests_attend_in_fp32_without_amx(without_amx, monkeypatch):
    """Without AMX, bf16 decode rows over few keys in all (requests x keys) attend through SDPA in fp32,
    faster there than either bf16 path; more keys, several queries a request, fp32 models and AMX CPUs
    keep their paths."""
    monkeypatch.setattr(attention, "bf16_sdpa_without_amx", lambda: without_amx)
    assert attention.widened_pays(torch.bfloat16, 1, 1, 200) == without_amx
    assert attention.widened_pays(torch.bfloat16, 4, 1, 200) == without_amx
    assert not attention.widened_pays(torch.bfloat16, 8, 1, 200)
    assert not attention.widened_pays(torch.bfloat16, 1, 8, 100)
    assert not attention.widened_pays(torch.float32, 1, 1, 100)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (4, 4)])
def test_grouped_attention_equals_sdpa(heads, kv_heads):
    """grouped_attention (a query head group's rows in one product per KV head) equals SDPA's
    enable_gqa in fp32, padded query rows and garbage keys included."""
    g = torch.Generator().manual_seed(heads * 7 + kv_heads)
    b, q_len, k_len, d = 8, 3, 13, 16
    q = torch.randn(b, heads, q_len, d, generator=g)
    k, v = (torch.randn(b, kv_heads, k_len, d, generator=g) for _ in range(2))
    mask = torch.rand(b, 1, q_len, k_len, generator=g) < 0.5
    mask[..., 0] = True
    mask[:, :, -1, 1:] = False  # a padded query row: one key
    k[..., -1, :], v[..., -1, :] = GARBAGE, GARBAGE
    mask[..., -1] = False
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, 0.25), want, rtol=1e-5, atol=1e-5)


def test_ragged_batch_equals_requests_one_by_one(tiny_target):
    """A batch mixing prefill, decode and verify equals each request alone, where everything
    outside that request's own slots is different garbage; the pass writes only its new slots."""
    p = _load_pair(tiny_target)
    slots = Slots(seed=6)
    prefixes, batch = _ragged_batch(slots)
    kv = garbage_pool(p.ours, seed=6)
    for prefix in prefixes:
        ours_forward(p.ours, kv, [prefix])
    before = snapshot(kv)
    batched, _ = ours_forward(p.ours, kv, batch)

    written = torch.cat([r.slots for r in batch])
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[written] = False
    for old, new in zip(before, kv.k + kv.v):
        assert torch.equal(old[:, untouched], new[:, untouched]), "the batch wrote outside its new tokens' slots"

    for b, req in enumerate(batch):
        alone = garbage_pool(p.ours, seed=100 + b)  # other requests' slots now hold other values
        for old, new in zip(before, alone.k + alone.v):
            new[:, req.prefix_slots] = old[:, req.prefix_slots]
        (logits,), _ = ours_forward(p.ours, alone, [req])
        assert_close(batched[b], logits, what=f"request {b} batched vs alone")
        assert_close(batched[b], hf_expected(p.hf, req), what=f"request {b} vs transformers")


def test_ragged_batch_on_every_config(pair):
    """The same batch on each architecture variant, against transformers request by request."""
    slots = Slots(seed=7)
    prefixes, batch = _ragged_batch(slots)
    kv = garbage_pool(pair.ours, seed=7)
    for prefix in prefixes:
        ours_forward(pair.ours, kv, [prefix])
    batched, _ = ours_forward(pair.ours, kv, batch)
    for b, req in enumerate(batch):
        assert_close(batched[b], hf_expected(pair.hf, req), what=f"request {b}")


def test_a_decode_batch_attending_grouped_matches_transformers(tiny_target):
    """Enough one-token decode rows that attention runs grouped (`grouped_pays`), over prefixes of
    different lengths in shuffled slots: each request's logits equal transformers'."""
    p = _load_pair(tiny_target)
    slots, kv = Slots(seed=8), garbage_pool(p.ours, seed=8)
    prefixes = [prefill_req(rand_tokens(3 + i % 7, seed=40 + i), slots) for i in range(16)]
    for prefix in prefixes:
        ours_forward(p.ours, kv, [prefix])
    batch = [prefill_req(rand_tokens(1, seed=60 + i), slots, prefix=prefix) for i, prefix in enumerate(prefixes)]
    assert grouped_pays(torch.float32, len(batch), 1, 10)
    batched, _ = ours_forward(p.ours, kv, batch)
    for b, req in enumerate(batch):
        assert_close(batched[b], hf_expected(p.hf, req), what=f"decode row {b}")


def test_fresh_prefills_of_several_lengths_match_transformers(pair):
    """Prompts prefilled from scratch together take the unpadded causal path (no prefix, no
    tree mask) and each equals transformers; one with a prefix in the pass takes the masked one."""
    slots, kv = Slots(seed=8), garbage_pool(pair.ours, seed=8)
    batch = [prefill_req(rand_tokens(n, seed=20 + n), slots) for n in (5, 17, 9)]
    meta = AttentionMetadata.build([r.prefix_slots for r in batch], [r.slots for r in batch],
                                   torch.cat([r.positions for r in batch]), [r.mask for r in batch])
    assert meta.fresh_lens == [5, 17, 9]
    batched, _ = ours_forward(pair.ours, kv, batch)
    for b, req in enumerate(batch):
        assert_close(batched[b], hf_expected(pair.hf, req), what=f"fresh prompt {b}")
    decode = prefill_req([3], slots, prefix=batch[0])
    assert AttentionMetadata.build([decode.prefix_slots], [decode.slots], decode.positions, [None]).fresh_lens is None


def test_mixed_step_attends_in_parts_and_matches_transformers(pair):
    """A mixed step's batch: a verify tree and a decode first, then a short prompt chunk and chunks
    longer than LONG_QUERIES (one over a prefix, one from scratch). It attends in four parts (no
    request's queries are padded to a longer kind's: the decode row to the tree's or the chunk's) and
    every request equals transformers."""
    from models.attention import LONG_QUERIES

    slots, kv = Slots(seed=9), garbage_pool(pair.ours, seed=9)
    p1, p2, p3, p4 = (prefill_req(rand_tokens(n, seed=40 + n), slots) for n in (8, 5, 11, 4))
    for prefix in (p1, p2, p3, p4):
        ours_forward(pair.ours, kv, [prefix])
    batch = [
        tree_req(p1, rand_tokens(5, seed=51), [-1, 0, 0, 1, 2], slots),
        prefill_req(rand_tokens(1, seed=52), slots, prefix=p2),
        prefill_req(rand_tokens(6, seed=55), slots, prefix=p4),
        prefill_req(rand_tokens(LONG_QUERIES + 7, seed=53), slots, prefix=p3),
        prefill_req(rand_tokens(LONG_QUERIES + 3, seed=54), slots),
    ]
    meta = AttentionMetadata.build([r.prefix_slots for r in batch], [r.slots for r in batch],
                                   torch.cat([r.positions for r in batch]), [r.mask for r in batch])
    assert [(a, b) for a, b, _ in meta.parts] == [(0, 5), (5, 6), (6, 12), (12, 12 + 2 * LONG_QUERIES + 10)]
    batched, _ = ours_forward(pair.ours, kv, batch)
    for b, req in enumerate(batch):
        assert_close(batched[b], hf_expected(pair.hf, req), what=f"mixed request {b}")


# --------------------------------------------------------------------------- 2. aux hidden states


def _check_aux(p: Pair, reqs: list[Req], kv, atol: float) -> None:
    num_layers, width = p.num_layers, p.ours.shape.hidden_size
    ids = [2, num_layers // 2, num_layers - 3]
    _, aux = ours_forward(p.ours, kv, reqs, aux_layer_ids=ids)
    for req, got in zip(reqs, aux):
        assert got.shape == (len(req.tokens), len(ids) * width)
        states = hf_run(p.hf, req.prefix_tokens + req.tokens).hidden_states
        for j, layer in enumerate(ids):
            assert_close(got[:, j * width : (j + 1) * width], states[layer][0, -len(req.tokens):], atol=atol,
                         what=f"aux layer {layer} (input of layer {layer})")


def test_aux_hidden_states_are_layer_inputs(pair):
    """aux = cat(hidden_states[i] for i in [2, L//2, L-3]) in transformers' numbering
    (hidden_states[i] is the input of layer i), for a prefill and a decode step after it."""
    slots, kv = Slots(seed=8), garbage_pool(pair.ours, seed=8)
    first = prefill_req(rand_tokens(9, seed=8), slots)
    _check_aux(pair, [first], kv, atol=ATOL)
    _check_aux(pair, [prefill_req(rand_tokens(1, seed=9), slots, prefix=first)], kv, atol=ATOL)


def test_no_aux_requested_returns_none(tiny_target):
    p = _load_pair(tiny_target)
    _, aux = ours_forward(p.ours, garbage_pool(p.ours, 0), [prefill_req([1, 2, 3], Slots(0))])
    assert aux is None


# --------------------------------------------------------------------------- 3. drafts and loading


def _src(folder) -> ModelSource:
    return ModelSource.resolve(folder)


def test_eagle3_same_width_shares_target_embeddings(tiny_target, tiny_eagle3_shared):
    target = build_target(_src(tiny_target), FP32, "cpu")
    draft = build_draft(SpecAlgorithm.EAGLE3, _src(tiny_eagle3_shared), _src(tiny_target), FP32, "cpu")
    assert draft.shape.hidden_size == target.shape.hidden_size == 64
    assert draft.fc.in_features == 3 * 64
    assert torch.equal(draft.embed_tokens.weight, target.model.embed_tokens.weight)
    assert draft.draft_vocab_size == 64 and torch.equal(draft.d2t, torch.zeros(64, dtype=torch.long))
    assert bool(draft.t2d.all())


def test_eagle3_narrow_own_embeddings_and_draft_vocab(tiny_target, tiny_eagle3_own):
    draft = build_draft(SpecAlgorithm.EAGLE3, _src(tiny_eagle3_own), _src(tiny_target), FP32, "cpu")
    state = load_file(str(Path(tiny_eagle3_own) / "model.safetensors"))
    assert draft.shape.hidden_size == 32 and draft.fc.in_features == 3 * 64
    assert torch.equal(draft.embed_tokens.weight, state["embed_tokens.weight"])
    assert draft.embed_tokens.weight.shape == (64, 32)
    assert draft.draft_vocab_size == 32 and draft.lm_head.weight.shape == (32, 32)
    assert torch.equal(draft.d2t, state["d2t"]) and torch.equal(draft.t2d, state["t2d"])

    slots = Slots(seed=12)
    kv = draft.make_kv_pool(NUM_SLOTS, FP32, "cpu")
    n = 6
    meta = AttentionMetadata.build([torch.zeros(0, dtype=torch.long)], [slots.take(n)], torch.arange(n), [None])
    hidden = torch.randn(n, 3 * 64, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        recurrent, head = draft.draft_forward(torch.tensor(rand_tokens(n, 12)), hidden, meta, kv, from_target=True)
        assert recurrent.shape == head.shape == (n, 32)
        probs, ids = draft.topk(head, 8)
    assert probs.shape == ids.shape == (n, 8) and ids.dtype == torch.long
    assert bool((ids >= 0).all()) and bool((ids < 64).all())
    assert bool((ids % 2 == 0).all()), "draft id i maps to target id 2i in this checkpoint"
    assert bool(draft.t2d[ids].all()), "every proposed target id must be in the draft vocabulary (t2d)"
    assert bool((ids.max() > 31)), "ids are target ids, not draft ids"


def test_standalone_hot_vocab_proposes_only_its_ids(tiny_target, tiny_standalone, tiny_standalone_hot):
    """A hot vocabulary keeps the LM head's rows of its ids only (inputs still embed every id) and
    proposes those ids with the full draft's probabilities renormalised over them."""
    full = build_draft(SpecAlgorithm.STANDALONE, _src(tiny_standalone), _src(tiny_target), FP32, "cpu")
    hot = build_draft(SpecAlgorithm.STANDALONE, _src(tiny_standalone_hot), _src(tiny_target), FP32, "cpu")
    ids = torch.arange(0, 64, 2)
    assert hot.draft_vocab_size == 32 and hot.lm_head.weight.shape == (32, 32)
    assert hot.model.embed_tokens.weight.shape == (64, 32)
    assert torch.equal(hot.lm_head.weight, full.lm_head.weight[ids])

    n = 6
    tokens = torch.tensor(rand_tokens(n, 13))
    head = {}
    for name, draft in (("full", full), ("hot", hot)):
        kv = draft.make_kv_pool(NUM_SLOTS, FP32, "cpu")
        meta = AttentionMetadata.build([torch.zeros(0, dtype=torch.long)], [Slots(seed=13).take(n)], torch.arange(n), [None])
        with torch.no_grad():
            head[name] = draft.draft_forward(tokens, None, meta, kv, from_target=False)[1]  # (n, 32)
    assert torch.allclose(head["full"], head["hot"])
    with torch.no_grad():
        probs, proposed = hot.topk(head["hot"], 4)
        expect = full.logits(head["full"])[:, ids].softmax(-1).topk(4)
    assert bool((proposed % 2 == 0).all()) and bool((proposed.max() > 31))  # target ids, not draft rows
    assert torch.equal(proposed, ids[expect.indices]) and torch.allclose(probs, expect.values)


def test_standalone_hot_vocab_without_d2t(tiny_target, tiny_standalone_hot, tmp_path):
    draft = _copy(tiny_standalone_hot, tmp_path / "nod2t")
    _edit_tensors(draft, lambda s: s.pop("d2t"))
    with pytest.raises(CheckpointError, match="d2t") as err:
        build_draft(SpecAlgorithm.STANDALONE, _src(draft), _src(tiny_target), FP32, "cpu")
    assert "draft_vocab_size" in str(err.value) and str(draft) in str(err.value)


def test_draft_vocab_map_outside_the_target_vocab(tiny_target, tiny_standalone_hot, tmp_path):
    draft = _copy(tiny_standalone_hot, tmp_path / "bad")
    _edit_tensors(draft, lambda s: s["d2t"].add_(40))
    with pytest.raises(CheckpointError, match="d2t") as err:
        build_draft(SpecAlgorithm.STANDALONE, _src(draft), _src(tiny_target), FP32, "cpu")
    assert str(draft) in str(err.value)


def test_eagle_v1_shares_embeddings_and_lm_head(tiny_target, tiny_eagle):
    target = build_target(_src(tiny_target), FP32, "cpu")
    draft = build_draft(SpecAlgorithm.EAGLE, _src(tiny_eagle), _src(tiny_target), FP32, "cpu")
    assert torch.equal(draft.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    assert draft.fc.in_features == 2 * 64 and draft.fc.bias is not None


@pytest.mark.parametrize("layout", [{"prefix": "model."}, {"layer": "layers.0"}, {"layer": "layers.0", "prefix": "model."}])
def test_eagle3_layouts_load_the_same_head(tiny_target, tmp_path, layout):
    """One head (same seed) saved under SpecForge/EAGLE-authors names (bare, `midlayer.*`), SGLang's
    (`model.` prefix) and vLLM's (`layers.0.*`) loads into identical modules."""
    common = dict(hidden=32, draft_vocab=32, own_embeddings=True, seed=31)
    reference = make_eagle3(tmp_path / "midlayer", tiny_target, **common)
    other = make_eagle3(tmp_path / "other", tiny_target, **common, **layout)
    assert set(load_file(str(other / "model.safetensors"))) != set(load_file(str(reference / "model.safetensors")))
    a, b = (build_draft(SpecAlgorithm.EAGLE3, _src(d), _src(tiny_target), FP32, "cpu").state_dict()
            for d in (reference, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eagle_authors_head_is_known_by_its_tensors(tiny_target, tmp_path):
    """The EAGLE authors' EAGLE-1/2 heads declare LlamaForCausalLM: their fc and layers.0.* make
    them an EAGLE head, with the target's embeddings and LM head."""
    from models.build import draft_kind

    draft = make_eagle(tmp_path / "authors", tiny_target, architectures=("LlamaForCausalLM",))
    source = _src(draft)
    assert draft_kind(source.config, source.tensor_names()) is SpecAlgorithm.EAGLE
    assert draft_kind(_src(tiny_target).config, _src(tiny_target).tensor_names()) is SpecAlgorithm.STANDALONE
    model = build_draft(SpecAlgorithm.EAGLE, source, _src(tiny_target), FP32, "cpu")
    target = build_target(_src(tiny_target), FP32, "cpu")
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)
    with pytest.raises(CheckpointError, match=r"'architectures' is \['LlamaForCausalLM'\].*EAGLE draft.*STANDALONE"):
        build_draft(SpecAlgorithm.STANDALONE, source, _src(tiny_target), FP32, "cpu")


def test_eagle3_without_lm_head_needs_the_whole_vocabulary(tiny_target, tmp_path):
    from models.build import check_draft_checkpoint

    full = make_eagle3(tmp_path / "full", tiny_target, hidden=64, lm_head=False)
    target = build_target(_src(tiny_target), FP32, "cpu")
    model = build_draft(SpecAlgorithm.EAGLE3, _src(full), _src(tiny_target), FP32, "cpu")
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)
    reduced = make_eagle3(tmp_path / "reduced", tiny_target, hidden=64, draft_vocab=32, lm_head=False)
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' missing.*draft_vocab_size 32"):
        check_draft_checkpoint(SpecAlgorithm.EAGLE3, _src(reduced), _src(tiny_target))


def test_draft_checkpoint_checked_from_headers_before_loading(tiny_target, tmp_path, monkeypatch):
    """Startup checks every tensor name and shape of a draft from its files' headers: a head
    trained for another target width is refused naming the tensor, and no tensor is read."""
    from models.build import check_draft_checkpoint
    from models.loader import TensorSource

    def no_reads(self, name):
        raise AssertionError(f"read {name}")

    good = make_eagle3(tmp_path / "good", tiny_target, hidden=32, draft_vocab=32, own_embeddings=True)
    bad = _copy(good, tmp_path / "bad")
    _edit_tensors(bad, lambda s: s.update({"fc.weight": torch.zeros(32, 3 * 48)}))
    monkeypatch.setattr(TensorSource, "get", no_reads)
    check_draft_checkpoint(SpecAlgorithm.EAGLE3, _src(good), _src(tiny_target))
    with pytest.raises(CheckpointError, match=r"'fc\.weight' has shape \(32, 144\), the config implies \(32, 192\)"):
        check_draft_checkpoint(SpecAlgorithm.EAGLE3, _src(bad), _src(tiny_target))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_missing_config_json(tiny_target, tmp_path):
    folder = _copy(tiny_target, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json") as err:
        ModelSource.resolve(folder)
    assert str(folder) in str(err.value)


def test_malformed_config_json(tiny_target, tmp_path):
    folder = _copy(tiny_target, tmp_path / "m")
    (folder / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(CheckpointError, match="not valid JSON") as err:
        ModelSource.resolve(folder)
    assert str(folder / "config.json") in str(err.value)


def test_missing_tensor(tiny_target, tmp_path):
    folder = _copy(tiny_target, tmp_path / "m")
    _edit_tensors(folder, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' missing") as err:
        build_target(_src(folder), FP32, "cpu")
    assert str(folder) in str(err.value)


def test_wrong_shaped_tensor(tiny_target, tmp_path):
    folder = _copy(tiny_target, tmp_path / "m")
    _edit_tensors(folder, lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    for check in (lambda: build_target(_src(folder), FP32, "cpu"), lambda: check_target(_src(folder))):
        with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape \(64, 64\), the config implies \(32, 64\)") as err:
            check()
        assert str(folder) in str(err.value)


def test_unexpected_tensor(tiny_target, tmp_path):
    folder = _copy(tiny_target, tmp_path / "m")
    _edit_tensors(folder, lambda s: s.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*layers\.9"):
        build_target(_src(folder), FP32, "cpu")


def test_only_pickled_checkpoint_is_refused(tiny_target, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(Path(tiny_target) / "config.json", folder / "config.json")
    torch.save(load_file(str(Path(tiny_target) / "model.safetensors")), folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors") as err:
        ModelSource.resolve(folder)
    assert "pytorch_model.bin" in str(err.value) and str(folder) in str(err.value)


def test_narrow_eagle3_without_own_embeddings(tiny_target, tmp_path):
    from models.build import check_draft_checkpoint

    draft = make_eagle3(tmp_path / "narrow", tiny_target, hidden=32, own_embeddings=False)
    for check in (lambda: build_draft(SpecAlgorithm.EAGLE3, _src(draft), _src(tiny_target), FP32, "cpu"),
                  lambda: check_draft_checkpoint(SpecAlgorithm.EAGLE3, _src(draft), _src(tiny_target))):
        with pytest.raises(CheckpointError, match=r"no 'embed_tokens.weight' and the target's \(64, 64\)") as err:
            check()
        assert str(draft) in str(err.value)


def test_eagle3_reduced_vocab_without_d2t(tiny_target, tmp_path):
    draft = make_eagle3(tmp_path / "nod2t", tiny_target, hidden=64, draft_vocab=32)
    _edit_tensors(draft, lambda s: (s.pop("d2t"), s.pop("t2d")))
    with pytest.raises(CheckpointError, match="d2t") as err:
        build_draft(SpecAlgorithm.EAGLE3, _src(draft), _src(tiny_target), FP32, "cpu")
    assert "draft_vocab_size" in str(err.value) and str(draft) in str(err.value)


def test_eagle_algorithm_with_eagle3_checkpoint(tiny_target, tiny_eagle3_shared):
    with pytest.raises(CheckpointError, match="architectures") as err:
        build_draft(SpecAlgorithm.EAGLE, _src(tiny_eagle3_shared), _src(tiny_target), FP32, "cpu")
    message = str(err.value)
    assert "config.json" in message and "EAGLE3" in message and "LlamaForCausalLMEagle3" in message


def _shard(src: Path, dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in files.items():
        save_file({k: state[k] for k in keys}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_sharded_checkpoint_loads_like_single_file(tiny_target, tmp_path):
    sharded = _shard(Path(tiny_target), tmp_path / "sharded")
    assert not (sharded / "model.safetensors").exists()
    single = build_target(_src(tiny_target), FP32, "cpu")
    split = build_target(_src(sharded), FP32, "cpu")
    a, b = single.state_dict(), split.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    req = prefill_req(rand_tokens(8, 13), Slots(13))
    (la,), _ = ours_forward(single, garbage_pool(single, 13), [req])
    (lb,), _ = ours_forward(split, garbage_pool(split, 13), [req])
    assert torch.equal(la, lb)


def test_sharded_checkpoint_with_missing_shard(tiny_target, tmp_path):
    sharded = _shard(Path(tiny_target), tmp_path / "sharded")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        build_target(_src(sharded), FP32, "cpu")


@pytest.mark.parametrize("arch,dtype", [("qwen3", torch.bfloat16), ("mistral", torch.float16), ("llama", torch.float32)])
def test_sharded_half_precision_checkpoint_matches_transformers(arch, dtype, tmp_path):
    """A checkpoint saved by save_pretrained in bf16/fp16/fp32 across several shards (an index
    file, as published 4B-70B models come) serves the logits transformers computes from it."""
    extra = {"qwen3": {"head_dim": 24, "use_sliding_window": False}, "mistral": {"sliding_window": None}}.get(arch, {})
    folder = make_llama(tmp_path / arch, arch=arch, tie=False, layers=3, seed=12, dtype=dtype,
                        max_shard_size="40KB", **extra)
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    assert len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    p = _load_pair(folder)
    req = prefill_req(rand_tokens(11, 12), Slots(12))
    (logits,), _ = ours_forward(p.ours, garbage_pool(p.ours, 12), [req])
    assert_close(logits, hf_expected(p.hf, req), what=f"{arch} {dtype} sharded")


def test_unsupported_model_type_is_refused_naming_it(tiny_target, tmp_path):
    folder = _copy(tiny_target, tmp_path / "gemma")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model_type' is 'gemma2' \(architectures \['Gemma2ForCausalLM'\]\)") as err:
        build_target(ModelSource(folder, config), FP32, "cpu")
    assert "qwen3" in str(err.value) and str(folder) in str(err.value)


@pytest.mark.parametrize("arch,fields", [
    ("mistral", {"sliding_window": 128}),  # Mistral 7B v0.1 style: a window below the context
    ("qwen3", {"sliding_window": 128, "use_sliding_window": True, "max_window_layers": 1}),
])
def test_sliding_window_below_context_is_refused(arch, fields, tmp_path):
    folder = make_llama(tmp_path / arch, arch=arch, layers=2, max_pos=512, **fields)
    with pytest.raises(ValueError, match=r"'sliding_window' is 128.*max_position_embeddings 512") as err:
        build_target(_src(folder), FP32, "cpu")
    assert str(folder) in str(err.value)


def test_sliding_window_as_long_as_the_context_serves(tmp_path):
    """Mistral's default config carries a window; one that covers the whole context changes nothing."""
    p = _load_pair(make_llama(tmp_path / "mistral", arch="mistral", layers=2, max_pos=256, sliding_window=256))
    req = prefill_req(rand_tokens(9, 14), Slots(14))
    (logits,), _ = ours_forward(p.ours, garbage_pool(p.ours, 14), [req])
    assert_close(logits, hf_expected(p.hf, req), what="mistral with a window >= context")


def test_unknown_model_name_lists_registered_names():
    with pytest.raises(CheckpointError, match="no-such-model") as err:
        resolve_model("no-such-model")
    for name in REGISTRY:
        assert name in str(err.value)


def _permute_for_gguf(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf reorders q/k rows (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_folder: Path, path: Path) -> Path:
    """An F32 GGUF of a tiny HF Llama folder, written with the `gguf` package like llama.cpp does,
    with a minimal byte-level BPE tokenizer."""
    import gguf

    cfg = json.loads((hf_folder / "config.json").read_text())
    state = load_file(str(hf_folder / "model.safetensors"))
    vocab, hidden, heads, kv_heads = cfg["vocab_size"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = [chr(ord("a") + i) if i < 26 else f"<t{i}>" for i in range(vocab)]
    tokens[26] = "ab"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(vocab - 2)
    top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for key, tensor in state.items():
        array = tensor.float().numpy()
        if key in top:
            name = top[key] + ".weight"
        else:
            parts = key.split(".")  # model.layers.N.<module...>.weight
            module = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{per_layer[module]}.{parts[-1]}"
            if module == "self_attn.q_proj":
                array = _permute_for_gguf(array, heads)
            elif module == "self_attn.k_proj":
                array = _permute_for_gguf(array, kv_heads)
        w.add_tensor(name, array.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_file_path_is_converted_once(tiny_target, tmp_path, monkeypatch):
    """A .gguf path resolves to a converted HF folder in the cache whose weights equal the source's;
    resolving again reuses it."""
    monkeypatch.setenv("SPECGRAPH_CACHE", str(tmp_path / "cache"))
    gguf_path = _write_gguf(Path(tiny_target), tmp_path / "tiny.gguf")
    folder = resolve_model(gguf_path)
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("tiny-")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), name
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(gguf_path)) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp, "converted again"
    original = build_target(_src(tiny_target), FP32, "cpu").state_dict()
    converted = build_target(_src(folder), FP32, "cpu").state_dict()
    assert original.keys() == converted.keys()
    for key in original:
        assert torch.equal(original[key], converted[key]), key


def test_missing_gguf_file(tmp_path):
    with pytest.raises(CheckpointError, match="GGUF file not found") as err:
        resolve_model(tmp_path / "absent.gguf")
    assert "absent.gguf" in str(err.value)


# --------------------------------------------------------------------------- 4. runners


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_target_runner_constructs_and_runs_idle(tiny_target, restore_threads, dtype):
    from actors.target_runner import TargetRunner

    runner = TargetRunner(str(tiny_target), num_slots=32, dtype=dtype, device="cpu", num_threads=1)
    expected = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    assert torch.get_num_threads() == 1
    assert runner.device == torch.device("cpu")
    assert {p.dtype for p in runner.model.parameters()} == {expected}
    # Serving packs linears on CPU where oneDNN runs the dtype (models/packed.py).
    packed = any(isinstance(m, PackedLinear) for m in runner.model.modules())
    assert packed == can_pack(expected, "cpu")
    # 32 slots to hand out, and the pool's last: the dump slot padded rows write to (actors.cuda_graphs)
    assert runner.kv.k[0].dtype == expected and runner.num_slots == 32 and runner.kv.num_slots == 33
    out = runner.forward_step(BatchMeta.create_idle(), VerifyInput.create_idle(1))
    assert isinstance(out, DraftExtendInput) and out.num_requests == 0
    assert out.tokens.numel() == 0 and out.hidden_states is None


def test_target_runner_idle_eagle3_has_target_aux_width(tiny_target, tiny_eagle3_own):
    from actors.target_runner import TargetRunner

    runner = TargetRunner(str(tiny_target), "eagle3", str(tiny_eagle3_own), num_slots=32, device="cpu")
    assert runner.aux_layer_ids == [2, 2, 1]
    out = runner.forward_step(BatchMeta.create_idle(), VerifyInput.create_idle(4))
    assert out.num_requests == 0
    assert out.hidden_states.shape == (0, 3 * 64) and out.hidden_states.dtype == torch.float32


def _meta(seq_lens, kv_slots, verify_slots=None, prefill=None):
    """A BatchMeta for greedy requests: prefill = (tokens (B, P), slots (B, P)) or decode."""
    b = len(seq_lens)
    long = lambda *s: torch.zeros((b, *s), dtype=torch.long)  # noqa: E731
    tokens, pslots = prefill if prefill is not None else (long(0), long(0))
    return BatchMeta(
        seq_lens=torch.tensor(seq_lens), kv_slots=kv_slots,
        prefill_lens=torch.full((b,), tokens.shape[1], dtype=torch.long), prefill_tokens=tokens,
        prefill_slots=pslots, next_token=torch.full((b,), -1, dtype=torch.long), scratch_slots=long(0),
        verify_slots=verify_slots if verify_slots is not None else long(1), temperature=torch.zeros(b),
        top_p=torch.ones(b), top_k=long(), seeds=long(), history=long(0),
    )


def test_target_runner_prefill_then_decode_is_greedy_generation(tiny_target):
    """Prefill then one-node verify steps through forward_step produce transformers' greedy tokens
    (argmax of its logits at each step; generate() would suppress EOS differently)."""
    from transformers import AutoModelForCausalLM

    from actors.target_runner import TargetRunner

    runner = TargetRunner(str(tiny_target), num_slots=NUM_SLOTS, device="cpu")
    slots = Slots(seed=14)
    prompt = rand_tokens(7, 14)
    pslots = slots.take(7)
    ext = runner.forward_step(_meta([0], torch.zeros(1, 0, dtype=torch.long), prefill=(torch.tensor([prompt]), pslots[None])),
                              VerifyInput.create_idle(1))
    assert ext.extend_lens.tolist() == [7] and ext.next_tokens[:-1].tolist() == prompt[1:]
    out, committed = [int(ext.next_tokens[-1])], pslots
    for _ in range(5):
        pos = committed.numel()
        verify = VerifyInput(torch.tensor([[out[-1]]]), torch.tensor([[-1]]), torch.tensor([[pos]]),
                             torch.ones(1, 1, 1, dtype=torch.bool))
        vslot = slots.take(1)
        ext = runner.forward_step(_meta([pos], committed[None], verify_slots=vslot[None]), verify)
        assert ext.accept_lens.tolist() == [0] and ext.slots.tolist() == vslot.tolist()
        committed = torch.cat([committed, vslot])
        out.append(int(ext.next_tokens[-1]))
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=FP32).eval()
    ref = prompt[:]
    for _ in range(6):
        ref.append(int(hf_run(hf, ref).logits[0, -1].argmax()))
    assert out == ref[7:]


def test_draft_runner_constructs_and_checks_hidden_width(tiny_target, tiny_eagle3_own, restore_threads):
    from actors.draft_runner import DraftRunner

    runner = DraftRunner("eagle3", str(tiny_eagle3_own), str(tiny_target), num_steps=2, topk=2, tree_size=4,
                         num_slots=32, dtype="float32", device="cpu", num_threads=1)
    assert torch.get_num_threads() == 1
    assert {p.dtype for p in runner.model.parameters()} == {torch.float32}
    assert runner.input_spec.width == 3 * 64 and runner.hidden_spec.width == 32

    idle = runner.extend(BatchMeta.create_idle(), DraftExtendInput.create_idle(runner.input_spec))
    assert idle.num_requests == 0 and idle.hidden_states.shape == (0, 32) and idle.topk_index.shape == (0, 2)

    def ext(hidden):
        n = hidden.shape[0]
        return DraftExtendInput(
            tokens=torch.arange(n), next_tokens=torch.arange(1, n + 1), positions=torch.arange(n),
            slots=torch.arange(1, n + 1), hidden_states=hidden, extend_lens=torch.tensor([n]),
            accept_lens=torch.tensor([0]),
        )

    meta = _meta([0], torch.zeros(1, 0, dtype=torch.long))
    # The target's own hidden width (64) where EAGLE-3 needs 3 aux layers (192): the SGLang crash.
    with pytest.raises(ShapeContractError, match=r"draft\.extend input.*width 192.*\(4, 64\)"):
        runner.extend(meta, ext(torch.zeros(4, 64)))
    with pytest.raises(ShapeContractError, match=r"draft\.extend input.*bfloat16"):
        runner.extend(meta, ext(torch.zeros(4, 192, dtype=torch.bfloat16)))
    out = runner.extend(meta, ext(torch.randn(4, 192)))
    assert out.num_requests == 1 and out.hidden_states.shape == (1, 32) and out.topk_index.shape == (1, 2)


@needs_packing
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_draft_runner_packs_its_head_and_proposes_a_tree(tiny_target, tiny_eagle3_own, restore_threads, dtype):
    """The EAGLE-3 head served on CPU runs on packed, fused linears (its q/k/v read 2H-wide
    rows) and still proposes a well-formed tree over its committed tokens."""
    from dataclasses import replace

    from actors.draft_runner import DraftRunner

    runner = DraftRunner("eagle3", str(tiny_eagle3_own), str(tiny_target), num_steps=3, topk=2, tree_size=5,
                         num_slots=64, dtype=dtype, device="cpu", num_threads=1)
    assert runner.model.midlayer.self_attn.qkv_proj is not None
    assert isinstance(runner.model.lm_head, PackedLinear) and isinstance(runner.model.fc, PackedLinear)
    n = 4
    ext = DraftExtendInput(
        tokens=torch.arange(n), next_tokens=torch.arange(1, n + 1), positions=torch.arange(n),
        slots=torch.arange(1, n + 1), hidden_states=torch.randn(n, 192, dtype=dtype), extend_lens=torch.tensor([n]),
        accept_lens=torch.tensor([0]),
    )
    draft_input = runner.extend(_meta([0], torch.zeros(1, 0, dtype=torch.long)), ext)
    meta = replace(_meta([n], torch.arange(1, n + 1).unsqueeze(0), verify_slots=torch.arange(20, 25).unsqueeze(0)),
                   scratch_slots=torch.arange(10, 14).unsqueeze(0))  # a 5-node step: the verify width says it
    verify = runner.propose(meta, draft_input)
    assert verify.draft_tokens.shape == (1, 5) and verify.parents[0, 0] == -1
    assert (verify.parents[0, 1:] < torch.arange(1, 5)).all()  # parents come before their children
    assert int(verify.draft_tokens[0, 0]) == n  # the root is the last committed token


# --------------------------------------------------------------------------- real SmolLM2 (integration)


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    folder = resolve_model(DEFAULT_MODEL)
    p = _load_pair(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours and explain why."}],
                                   tokenize=False, add_generation_prompt=True)
    return SimpleNamespace(pair=p, prompt=tok(text)["input_ids"], vocab=p.ours.shape.vocab_size)


SMOL_ATOL = 2e-4  # 30 layers in fp32; the logits themselves reach about 30


@pytest.mark.integration
def test_registry_name_resolves_to_hf_folder():
    folder = resolve_model(DEFAULT_MODEL)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    assert resolve_model(DEFAULT_MODEL) == folder  # converted once, then cached


@pytest.mark.integration
def test_smollm2_prefill_matches_transformers(smol):
    p = smol.pair
    assert p.num_layers == 30 and p.ours.shape.num_kv_heads == 3 and p.ours.shape.tie_word_embeddings
    req = prefill_req(smol.prompt, Slots(seed=15, num_slots=128))
    (logits,), _ = ours_forward(p.ours, garbage_pool(p.ours, 15, num_slots=128), [req])
    assert_close(logits, hf_expected(p.hf, req), atol=SMOL_ATOL, what="SmolLM2 prefill logits")


@pytest.mark.integration
def test_smollm2_tree_verify_matches_per_branch_forwards(smol):
    p = smol.pair
    slots, kv = Slots(seed=16, num_slots=128), garbage_pool(p.ours, 16, num_slots=128)
    prefix = prefill_req(smol.prompt, slots)
    ours_forward(p.ours, kv, [prefix])
    tree = tree_req(prefix, rand_tokens(len(TREE_PARENTS), 16, vocab=smol.vocab), TREE_PARENTS, slots)
    (logits,), _ = ours_forward(p.ours, kv, [tree])
    assert_close(logits, hf_expected(p.hf, tree), atol=SMOL_ATOL, what="SmolLM2 tree verify logits")


@pytest.mark.integration
def test_smollm2_aux_hidden_states(smol):
    p = smol.pair
    slots, kv = Slots(seed=17, num_slots=128), garbage_pool(p.ours, 17, num_slots=128)
    first = prefill_req(smol.prompt, slots)
    _check_aux(p, [first], kv, atol=SMOL_ATOL)
    _check_aux(p, [prefill_req([smol.prompt[3]], slots, prefix=first)], kv, atol=SMOL_ATOL)


# --------------------------------------------------------------------------- prepacked linears

# Packed against plain, per dtype: fp32 products differ only in summation order; bf16 ones both
# accumulate in fp32 and may differ in the final rounding to bf16 (8 bits of mantissa).
PACK_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


@needs_packing
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 8, 17, 37])  # 17 and 37 rows run padded (to 20 and 40)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias, dtype):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(48, 40, bias=bias, dtype=dtype)
    x = torch.randn(rows, 48, dtype=dtype)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                              None if linear.bias is None else linear.bias.float())
        got = PackedLinear(linear, product_dtype(dtype, "cpu"))(x)
    assert got.shape == (rows, 40) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=PACK_TOL[dtype], atol=PACK_TOL[dtype])


@needs_packing
def test_packed_linear_runs_few_row_counts(monkeypatch):
    """oneDNN builds and caches a product per input shape (~0.6 MB each for the EAGLE-3 head), and
    a server's row counts (batch x tree nodes, summed prompt lengths) keep taking new values: the
    draft actor's RSS grew through a whole soak (docs/benchmarks.md). Whatever the rows, the
    products run on a few shapes: every count up to 16, then 4 per doubling."""
    shapes = set()
    real = torch.ops.mkldnn._linear_pointwise

    def recording(x, *args):
        shapes.add(tuple(x.shape))
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    linear = PackedLinear(torch.nn.Linear(8, 4))
    for rows in range(1, 1025):
        assert linear(torch.randn(rows, 8)).shape == (rows, 4)
    assert len(shapes) == 16 + 4 * 6  # 1..16, then 17-32, ..., 513-1024


@needs_packing
@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_target_matches_unpacked(pair, dtype):
    """On every config (biases, untied heads, MQA, Qwen2): packing fuses q/k/v and gate/up, swaps
    every linear layer (a tied LM head included) and changes logits only by rounding; the
    embeddings a tied LM head shares stay usable."""
    source = ModelSource.resolve(pair.folder)
    plain = build_target(source, dtype, "cpu")
    packed = build_target(source, dtype, "cpu")
    # Per layer: qkv, o, gate_up, down; then the LM head.
    assert pack_linears(packed, dtype, "cpu") == 4 * packed.shape.num_layers + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    slots = Slots(11)
    reqs = [prefill_req(rand_tokens(9, 1), slots), prefill_req(rand_tokens(5, 2), slots)]
    results = [ours_forward(m, m.make_kv_pool(NUM_SLOTS, dtype, "cpu"), reqs)[0] for m in (plain, packed)]
    tol = ATOL if dtype == FP32 else 0.05
    for a, b in zip(*results):
        assert_close(b.float(), a.float(), atol=tol * max(1.0, a.abs().max().item()), what="packed vs plain logits")


@needs_packing
@pytest.mark.parametrize("rows", [1, 9, 37])
def test_widened_bf16_product_is_a_bf16_product(rows):
    """Where oneDNN has no bf16 product, a bf16 linear packed widened computes what a native one
    does: bf16 operands, fp32 sums, a bf16 result (its fp32 product rounded once)."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()).bfloat16()
        got = PackedLinear(linear, torch.float32)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    # fp32 sums in another order round to the same bf16 but for a last bit at a rounding boundary
    torch.testing.assert_close(got, expected, rtol=2**-8, atol=1e-6)


@needs_packing
def test_widened_linear_reads_its_bf16_weight_for_one_row(monkeypatch):
    """A single row (batch-1 decode) only reads the weights: a widened linear runs it on the bf16
    weight, half the bytes of its fp32 one, and never calls oneDNN; two rows go to the packed product."""
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(x.shape) or real(x, *a))
    linear = torch.nn.Linear(64, 48, dtype=torch.bfloat16)
    packed = PackedLinear(linear, torch.float32)
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)  # (B, T, in): one row
    with torch.no_grad():
        assert torch.equal(packed(x), torch.nn.functional.linear(x, linear.weight, linear.bias)) and not calls
        assert packed(torch.randn(2, 64, dtype=torch.bfloat16)).shape == (2, 48) and calls == [(2, 64)]


def test_bf16_runner_without_native_bf16_packs_widened(tiny_target, restore_threads, monkeypatch):
    """On a CPU where oneDNN cannot run bf16 (AVX2 only) its bf16 weight reorder raises; the runner
    still loads a bf16 model, packs its linears widened to fp32 (on plain bf16 linears a product's
    cost grew with its rows: a verify or a batch cost several times a decode row), keeps the model's
    activations and KV in bf16, and decodes."""
    from actors.target_runner import TargetRunner

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert product_dtype(torch.bfloat16, "cpu") == FP32
    runner = TargetRunner(str(tiny_target), num_slots=32, dtype="bfloat16", device="cpu", num_threads=1)
    linears = [m for m in runner.model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) and m.product_dtype == FP32 for m in linears)
    assert runner.kv.k[0].dtype == torch.bfloat16
    prompt = rand_tokens(7, 21)
    ext = runner.forward_step(_meta([0], torch.zeros(1, 0, dtype=torch.long),
                                    prefill=(torch.tensor([prompt]), torch.arange(1, 8)[None])), VerifyInput.create_idle(1))
    assert ext.extend_lens.tolist() == [7] and 0 <= int(ext.next_tokens[-1]) < runner.model.shape.vocab_size


def test_cuda_and_unknown_dtypes_are_not_packed(tiny_target):
    model = build_target(ModelSource.resolve(tiny_target), torch.float16, "cpu")
    assert not can_pack(FP32, "cuda") and not can_pack(torch.bfloat16, "cuda") and not can_pack(torch.float16, "cpu")
    assert pack_linears(model, torch.float16, "cpu") == 0
    assert isinstance(model.lm_head, torch.nn.Linear)
