"""Batch state of spec/batch.py: merge/filter of real and idle inputs, and the two SGLang crashes.

A property test drives all four batch classes through the same random sequence of merges
(real requests or idle placeholders, on either side) and filters (list, long tensor, bool
tensor, bool list), as the scheduler does, and compares them after every step with a plain
per-request model of what they must hold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

import spec
from spec import (
    BatchMeta,
    DraftExtendInput,
    DraftInput,
    HiddenStateSpec,
    ShapeContractError,
    SpecAlgorithm,
    VerifyInput,
)
from spec.shapes import get_draft_input_hidden_state_spec
from spec.tree import ancestor_mask, depths

# --------------------------------------------------------------------------- the world


@dataclass
class World:
    """One server configuration: algorithm, configs, dtype and the specs derived from them."""

    algorithm: SpecAlgorithm
    target_cfg: object
    draft_cfg: object
    dtype: torch.dtype
    topk: int
    num_draft_tokens: int
    scratch: int
    input_spec: HiddenStateSpec | None  # target hidden rows fed to the draft (T, Ht)
    recurrent_spec: HiddenStateSpec | None  # draft's own hidden state (B, Hd)


def make_world(algorithm, target_hidden, draft_hidden, eagle3_style, num_aux, use_llama, dtype,
               topk=2, num_draft_tokens=4, scratch=3) -> World:
    target = {"hidden_size": target_hidden, "num_hidden_layers": 12, "vocab_size": 1000}
    draft = None
    if algorithm.needs_draft_model:
        draft = {"hidden_size": draft_hidden, "num_hidden_layers": 1, "vocab_size": 1000}
    if algorithm is SpecAlgorithm.EAGLE3:
        ids = list(range(num_aux))
        draft.update({
            "default": {},
            "num_aux": {"num_aux_hidden_states": num_aux},
            "ids_top": {"eagle_aux_hidden_state_layer_ids": ids},
            "ids_eagle_config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}},
            "no_aux": {"eagle_config": {"use_aux_hidden_state": False}},
        }[eagle3_style])
    if use_llama:
        target = LlamaConfig(num_attention_heads=1, num_key_value_heads=1, **target)
        draft = None if draft is None else LlamaConfig(num_attention_heads=1, num_key_value_heads=1, **draft)
    return World(
        algorithm, target, draft, dtype, topk, num_draft_tokens, scratch,
        input_spec=get_draft_input_hidden_state_spec(algorithm, target, draft, dtype),
        recurrent_spec=spec.get_draft_recurrent_hidden_state_spec(algorithm, target, draft, dtype),
    )


@st.composite
def worlds(draw) -> World:
    algorithm = draw(st.sampled_from(list(SpecAlgorithm)))
    # Target and draft widths never coincide, so a confused width cannot pass unnoticed.
    target_hidden = draw(st.sampled_from([8, 24, 576]))
    draft_hidden = draw(st.sampled_from([4, 40, 256]))  # never target_hidden * num_aux either
    world = make_world(
        algorithm, target_hidden, draft_hidden,
        eagle3_style=draw(st.sampled_from(["default", "num_aux", "ids_top", "ids_eagle_config", "no_aux"])),
        num_aux=draw(st.integers(1, 4)),
        use_llama=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        topk=draw(st.integers(1, 3)),
        num_draft_tokens=draw(st.integers(1, 5)),
        scratch=draw(st.integers(0, 3)),
    )
    if algorithm.is_eagle:
        assert world.input_spec.width != world.recurrent_spec.width
    return world


# --------------------------------------------------------------------------- requests (the model)


@dataclass
class Request:
    """Everything one request contributes to each batch class, as unbatched tensors."""

    rid: int
    # DraftInput row
    verified_id: torch.Tensor  # ()
    d_hidden: torch.Tensor | None  # (Hd,)
    topk_p: torch.Tensor  # (K,)
    topk_index: torch.Tensor  # (K,)
    # VerifyInput row
    draft_tokens: torch.Tensor  # (N,)
    parents: torch.Tensor  # (N,)
    v_positions: torch.Tensor  # (N,)
    tree_mask: torch.Tensor  # (N, N)
    # DraftExtendInput segment
    tokens: torch.Tensor  # (n,)
    next_tokens: torch.Tensor  # (n,)
    e_positions: torch.Tensor  # (n,)
    slots: torch.Tensor  # (n,)
    e_hidden: torch.Tensor | None  # (n, Ht)
    accept_len: int
    # BatchMeta row: name -> () or (len,) tensor (padded fields vary in length)
    meta: dict


PADDED = {"kv_slots": 0, "prefill_tokens": 0, "prefill_slots": 0, "history": -1}


def make_request(world: World, rid: int, gen: torch.Generator) -> Request:
    def ints(*shape, high=1000):
        return torch.randint(0, high, shape, generator=gen)

    def hidden(rows, spec):
        """(rows, width) random rows of the spec's dtype; (width,) when rows is None."""
        if spec is None:
            return None
        shape = (spec.width,) if rows is None else (rows, spec.width)
        return torch.randn(shape, generator=gen).to(spec.dtype)

    n_nodes, k = world.num_draft_tokens, world.topk
    parents = torch.tensor([-1] + [int(ints(high=i)) for i in range(1, n_nodes)])  # a random tree
    mask = ancestor_mask(parents[None])[0]  # (N, N)
    seq_len = int(ints(high=7))
    extend = int(ints(high=5)) + 1
    accept = int(ints(high=extend))
    prefill = int(ints(high=4))
    next_tokens = ints(extend)
    meta = {
        "seq_lens": torch.tensor(seq_len), "kv_slots": ints(seq_len),
        "prefill_lens": torch.tensor(prefill), "prefill_tokens": ints(prefill), "prefill_slots": ints(prefill),
        "next_token": torch.tensor(-1 if rid % 2 else int(ints())), "scratch_slots": ints(world.scratch),
        "verify_slots": ints(n_nodes), "temperature": torch.rand((), generator=gen),
        "top_p": torch.rand((), generator=gen), "top_k": ints(high=50), "seeds": torch.tensor(rid),
        "history": ints(int(ints(high=6))),
    }
    return Request(
        rid=rid,
        verified_id=next_tokens[-1], d_hidden=hidden(None, world.recurrent_spec),
        topk_p=torch.rand(k, generator=gen), topk_index=ints(k),
        draft_tokens=ints(n_nodes), parents=parents,
        v_positions=seq_len + depths(mask), tree_mask=mask,
        tokens=ints(extend), next_tokens=next_tokens,
        e_positions=torch.arange(seq_len, seq_len + extend), slots=ints(extend, high=10_000),
        e_hidden=hidden(extend, world.input_spec),
        accept_len=accept, meta=meta,
    )


def pad_rows(rows: list[torch.Tensor], pad: int) -> torch.Tensor:
    """Variable-length 1-D long tensors -> (B, max_len) padded with `pad`."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def real_batches(world: World, reqs: list[Request]) -> dict:
    """Build the four batch objects the way a scheduler/runner would for these requests."""
    stack = lambda name: torch.stack([getattr(r, name) for r in reqs])  # noqa: E731
    cat = lambda name: torch.cat([getattr(r, name) for r in reqs])  # noqa: E731
    return {
        "draft": DraftInput(
            verified_id=stack("verified_id"),
            hidden_states=None if world.recurrent_spec is None else stack("d_hidden"),
            topk_p=stack("topk_p"), topk_index=stack("topk_index"),
        ),
        "verify": VerifyInput(
            draft_tokens=stack("draft_tokens"), parents=stack("parents"),
            positions=stack("v_positions"), tree_mask=stack("tree_mask"),
        ),
        "extend": DraftExtendInput(
            tokens=cat("tokens"), next_tokens=cat("next_tokens"), positions=cat("e_positions"),
            slots=cat("slots"), hidden_states=None if world.input_spec is None else cat("e_hidden"),
            extend_lens=torch.tensor([len(r.tokens) for r in reqs]),
            accept_lens=torch.tensor([r.accept_len for r in reqs]),
        ),
        "meta": BatchMeta(**{
            name: pad_rows([r.meta[name] for r in reqs], PADDED[name]) if name in PADDED
            else torch.stack([r.meta[name] for r in reqs])
            for name in reqs[0].meta
        }),
    }


def idle_batches(world: World) -> dict:
    """Zero-row inputs whose widths come only from the spec functions."""
    return {
        "draft": DraftInput.create_idle(world.recurrent_spec, world.topk),
        "verify": VerifyInput.create_idle(world.num_draft_tokens),
        "extend": DraftExtendInput.create_idle(world.input_spec),
        "meta": BatchMeta.create_idle(scratch=world.scratch, num_draft_tokens=world.num_draft_tokens),
    }


def padded_widths(batches: dict) -> dict:
    return {name: getattr(batches["meta"], name).shape[1] for name in PADDED}


# --------------------------------------------------------------------------- checking against the model


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual, expected)
    assert torch.equal(actual, expected)


def rows_of(reqs: list[Request], name: str, empty_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([getattr(r, name) for r in reqs]) if reqs else torch.zeros(empty_shape, dtype=dtype)


def check_draft_input(world: World, batch: DraftInput, reqs: list[Request]) -> None:
    b, k = len(reqs), world.topk
    assert batch.num_requests == b
    assert_same(batch.verified_id, rows_of(reqs, "verified_id", (0,), torch.long))  # (B,)
    assert_same(batch.topk_p, rows_of(reqs, "topk_p", (0, k), torch.float32))  # (B, K)
    assert_same(batch.topk_index, rows_of(reqs, "topk_index", (0, k), torch.long))  # (B, K)
    if world.recurrent_spec is None:
        assert batch.hidden_states is None
    else:
        world.recurrent_spec.check(batch.hidden_states, "DraftInput.hidden_states")  # (B, Hd)
        assert_same(batch.hidden_states, rows_of(reqs, "d_hidden", (0, world.recurrent_spec.width),
                                                 world.recurrent_spec.dtype))


def check_verify_input(world: World, batch: VerifyInput, reqs: list[Request]) -> None:
    n = world.num_draft_tokens
    assert batch.num_requests == len(reqs) and batch.num_draft_tokens == n
    assert_same(batch.draft_tokens, rows_of(reqs, "draft_tokens", (0, n), torch.long))  # (B, N)
    assert_same(batch.parents, rows_of(reqs, "parents", (0, n), torch.long))  # (B, N)
    assert_same(batch.positions, rows_of(reqs, "v_positions", (0, n), torch.long))  # (B, N)
    assert_same(batch.tree_mask, rows_of(reqs, "tree_mask", (0, n, n), torch.bool))  # (B, N, N)


def check_extend_input(world: World, batch: DraftExtendInput, reqs: list[Request]) -> None:
    assert batch.num_requests == len(reqs)
    assert batch.extend_lens.tolist() == [len(r.tokens) for r in reqs]
    assert batch.accept_lens.tolist() == [r.accept_len for r in reqs]
    total = sum(len(r.tokens) for r in reqs)
    for name in ("tokens", "next_tokens", "positions", "slots"):
        assert getattr(batch, name).shape == (total,), name  # (T,)
    if world.input_spec is None:
        assert batch.hidden_states is None
    else:
        world.input_spec.check(batch.hidden_states, "DraftExtendInput.hidden_states")  # (T, Ht)
        assert batch.hidden_states.shape[0] == total
    # Each request's segment is exactly what that request brought.
    for r, start, length in zip(reqs, batch.offsets.tolist(), batch.extend_lens.tolist()):
        seg = slice(start, start + length)
        assert_same(batch.tokens[seg], r.tokens)
        assert_same(batch.next_tokens[seg], r.next_tokens)
        assert_same(batch.positions[seg], r.e_positions)
        assert_same(batch.slots[seg], r.slots)
        if r.e_hidden is not None:
            assert_same(batch.hidden_states[seg], r.e_hidden)
    expected_new = [r.next_tokens[len(r.tokens) - r.accept_len - 1:].tolist() for r in reqs]
    assert batch.new_token_ids() == expected_new
    assert all(len(new) == r.accept_len + 1 for new, r in zip(expected_new, reqs))


def check_batch_meta(world: World, batch: BatchMeta, reqs: list[Request], widths: dict) -> None:
    assert batch.num_requests == len(reqs)
    for name in PADDED:
        value = getattr(batch, name)
        assert value.shape == (len(reqs), widths[name]) and value.dtype == torch.long, name  # (B, L) padded
        for row, r in zip(value, reqs):
            length = len(r.meta[name])
            assert_same(row[:length], r.meta[name])
            assert (row[length:] == PADDED[name]).all(), name
    for name in ("seq_lens", "prefill_lens", "next_token", "scratch_slots", "verify_slots",
                 "temperature", "top_p", "top_k", "seeds"):
        value = getattr(batch, name)
        assert value.shape[0] == len(reqs), name
        if reqs:
            assert_same(value, torch.stack([r.meta[name] for r in reqs]))
    assert batch.scratch_slots.shape == (len(reqs), world.scratch)
    assert batch.verify_slots.shape == (len(reqs), world.num_draft_tokens)
    assert batch.temperature.dtype == batch.top_p.dtype == torch.float32
    assert batch.top_k.dtype == batch.seeds.dtype == torch.long


def check_all(world: World, batches: dict, reqs: list[Request], widths: dict) -> None:
    check_draft_input(world, batches["draft"], reqs)
    check_verify_input(world, batches["verify"], reqs)
    check_extend_input(world, batches["extend"], reqs)
    check_batch_meta(world, batches["meta"], reqs, widths)


# --------------------------------------------------------------------------- the property test

merge_ops = st.tuples(st.just("merge"), st.integers(0, 3), st.booleans())  # (op, new requests (0 = idle), new on the left)
filter_ops = st.tuples(st.just("filter"), st.sampled_from(["list", "long", "bool", "boollist"]),
                       st.integers(0, 2**32))  # (op, index kind, subset seed)


def keep_argument(kind: str, chosen: list[int], num_rows: int):
    if kind == "list":
        return chosen
    if kind == "long":
        return torch.tensor(chosen, dtype=torch.long)
    mask = [i in chosen for i in range(num_rows)]
    return torch.tensor(mask, dtype=torch.bool) if kind == "bool" else mask


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(), ops=st.lists(st.one_of(merge_ops, filter_ops), min_size=1, max_size=10),
       seed=st.integers(0, 2**31))
def test_random_merges_and_filters_stay_consistent(world, ops, seed):
    gen = torch.Generator().manual_seed(seed)
    batches, reqs, next_rid = idle_batches(world), [], 0
    widths = padded_widths(batches)
    check_all(world, batches, reqs, widths)

    for op in ops:
        if op[0] == "merge":
            _, count, new_on_left = op
            new_reqs = [make_request(world, next_rid + i, gen) for i in range(count)]
            next_rid += count
            new = real_batches(world, new_reqs) if count else idle_batches(world)
            if new_on_left:
                batches = {k: new[k].merge(batches[k]) for k in batches}
                reqs = new_reqs + reqs
            else:
                batches = {k: batches[k].merge(new[k]) for k in batches}
                reqs = reqs + new_reqs
            widths = {n: max(widths[n], w) for n, w in padded_widths(new).items()}
        else:
            _, kind, subset_seed = op
            rng = random.Random(subset_seed)
            chosen = rng.sample(range(len(reqs)), rng.randint(0, len(reqs)))
            if kind.startswith("bool"):
                chosen.sort()  # a mask keeps rows in batch order
            keep = keep_argument(kind, chosen, len(reqs))
            batches = {k: v.filter(keep) for k, v in batches.items()}
            reqs = [reqs[i] for i in chosen]
        check_all(world, batches, reqs, widths)


# --------------------------------------------------------------------------- filter forms agree


@pytest.mark.parametrize("algorithm", list(SpecAlgorithm))
def test_filter_list_long_and_bool_agree(algorithm):
    world = make_world(algorithm, 576, 256, "default", 3, False, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    reqs = [make_request(world, rid, gen) for rid in range(5)]
    batches = real_batches(world, reqs)
    kept = [1, 3, 4]
    forms = [kept, torch.tensor(kept), torch.tensor([False, True, False, True, True]),
             [False, True, False, True, True]]
    for keep in forms:
        filtered = {k: v.filter(keep) for k, v in batches.items()}
        check_all(world, filtered, [reqs[i] for i in kept], padded_widths(batches))
    # An out-of-range row is an IndexError naming the batch size, not silent garbage.
    for batch in batches.values():
        with pytest.raises(IndexError, match="5 requests"):
            batch.filter([0, 5])
        with pytest.raises(IndexError):
            batch.filter(torch.tensor([-1]))


def test_extend_filter_reorders_ragged_segments_together():
    world = make_world(SpecAlgorithm.EAGLE3, 576, 256, "default", 3, False, torch.float32)
    gen = torch.Generator().manual_seed(1)
    reqs = [make_request(world, rid, gen) for rid in range(4)]
    extend = real_batches(world, reqs)["extend"]
    order = [3, 0, 2]
    check_extend_input(world, extend.filter(order), [reqs[i] for i in order])


def test_merge_rejects_other_types_and_one_sided_hidden():
    eagle3 = make_world(SpecAlgorithm.EAGLE3, 576, 256, "default", 3, False, torch.bfloat16)
    standalone = make_world(SpecAlgorithm.STANDALONE, 576, 256, "default", 3, False, torch.bfloat16)
    with pytest.raises(ShapeContractError, match="cannot merge"):
        DraftInput.create_idle(eagle3.recurrent_spec, 2).merge(VerifyInput.create_idle(4))
    with pytest.raises(ShapeContractError, match="cannot merge"):
        DraftExtendInput.create_idle(eagle3.input_spec).merge(DraftInput.create_idle(None, 2))
    with pytest.raises(ShapeContractError, match="None on one side"):
        DraftExtendInput.create_idle(eagle3.input_spec).merge(DraftExtendInput.create_idle(standalone.input_spec))
    with pytest.raises(ShapeContractError, match="topk_p"):
        DraftInput.create_idle(None, 2).merge(DraftInput.create_idle(None, 3))
    with pytest.raises(ShapeContractError, match="hidden_states"):
        DraftInput.create_idle(HiddenStateSpec(256, torch.bfloat16), 2).merge(
            DraftInput.create_idle(HiddenStateSpec(256, torch.float32), 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_filter_keeps_device_tensors_on_their_device():
    """Hidden rows live on the GPU while lengths stay on the CPU; filtering must not mix devices."""
    world = make_world(SpecAlgorithm.EAGLE3, 576, 256, "default", 3, False, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    reqs = [make_request(world, rid, gen) for rid in range(3)]
    batches = real_batches(world, reqs)
    extend, draft = batches["extend"], batches["draft"]
    extend.hidden_states, extend.tokens = extend.hidden_states.cuda(), extend.tokens.cuda()
    draft.hidden_states = draft.hidden_states.cuda()
    for keep in ([2, 0], torch.tensor([2, 0]), torch.tensor([True, False, True])):
        kept_extend, kept_draft = extend.filter(keep), draft.filter(keep)
        assert kept_extend.hidden_states.is_cuda and kept_extend.tokens.is_cuda and kept_draft.hidden_states.is_cuda
    assert torch.equal(extend.filter([2]).tokens.cpu(), reqs[2].tokens)


# --------------------------------------------------------------------------- SGLang regressions

# The configuration of both crashes: target hidden 576 (30 layers), EAGLE3 draft hidden 256.
TARGET_576 = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}
DRAFT_256 = {"hidden_size": 256, "num_hidden_layers": 1, "vocab_size": 49152,
             "target_hidden_size": 576, "draft_vocab_size": 8192}


def _eagle3_specs(dtype=torch.bfloat16):
    args = (SpecAlgorithm.EAGLE3, TARGET_576, DRAFT_256, dtype)
    return get_draft_input_hidden_state_spec(*args), spec.get_draft_recurrent_hidden_state_spec(*args)


def test_regression_fc_in_features_is_not_the_draft_width():
    """SGLang read the draft width off `fc.in_features`; for EAGLE3 that is num_aux * target hidden."""
    input_spec, recurrent_spec = _eagle3_specs()
    fc = torch.nn.Linear(3 * 576, 256, bias=False, dtype=torch.bfloat16)  # the EAGLE3 fc: (1728 -> 256)

    assert input_spec.width == fc.in_features == 1728
    assert recurrent_spec.width == fc.out_features == 256
    assert fc.in_features != recurrent_spec.width

    # What crosses the actors: aux rows (T, 1728) into fc, the draft state (B, 256) out of it.
    aux = torch.randn(5, 1728, dtype=torch.bfloat16)
    input_spec.check(aux, "target -> draft.extend")
    recurrent_spec.check(fc(aux), "draft.extend -> scheduler")

    # The buggy width makes an idle DraftInput that cannot join a real one: a clear contract error.
    real = DraftInput(verified_id=torch.arange(5), hidden_states=fc(aux).detach(),
                      topk_p=torch.rand(5, 1), topk_index=torch.zeros(5, 1, dtype=torch.long))
    right_idle = DraftInput.create_idle(recurrent_spec, topk=1)
    assert real.merge(right_idle).hidden_states.shape == (5, 256)
    assert right_idle.merge(real).hidden_states.shape == (5, 256)
    wrong_idle = DraftInput.create_idle(HiddenStateSpec(fc.in_features, torch.bfloat16), topk=1)
    with pytest.raises(ShapeContractError, match=r"hidden_states.*1728.*256|hidden_states.*256.*1728"):
        real.merge(wrong_idle)


def _real_extend(hidden_width: int) -> DraftExtendInput:
    """Two requests (3 and 2 tokens) whose hidden rows are target-side (T=5, hidden_width)."""
    return DraftExtendInput(
        tokens=torch.arange(5), next_tokens=torch.arange(1, 6), positions=torch.tensor([0, 1, 2, 7, 8]),
        slots=torch.arange(10, 15), hidden_states=torch.randn(5, hidden_width).to(torch.bfloat16),
        extend_lens=torch.tensor([3, 2]), accept_lens=torch.tensor([0, 1]),
    )


def test_regression_idle_extend_sized_from_spec_merges_both_ways():
    """SGLang sized the idle placeholder with the draft hidden size; merge_batch crashed."""
    input_spec, _ = _eagle3_specs()
    real = _real_extend(1728)
    idle = DraftExtendInput.create_idle(input_spec)  # (0, 1728)
    for merged in (real.merge(idle), idle.merge(real), idle.merge(real).merge(idle)):
        assert merged.num_requests == 2
        assert merged.hidden_states.shape == (5, 1728)
        assert torch.equal(merged.hidden_states, real.hidden_states)
        assert merged.new_token_ids() == [[3], [4, 5]]
    # An idle rank merged with another idle rank stays idle and well formed.
    both_idle = idle.merge(DraftExtendInput.create_idle(input_spec))
    assert both_idle.num_requests == 0 and both_idle.hidden_states.shape == (0, 1728)


def test_regression_idle_with_draft_width_is_a_contract_error():
    _, recurrent_spec = _eagle3_specs()
    real = _real_extend(1728)
    wrong_idle = DraftExtendInput.create_idle(recurrent_spec)  # (0, 256): the SGLang bug

    # Without the contract, this is the raw torch failure SGLang hit inside merge_batch.
    with pytest.raises(RuntimeError):
        torch.cat([real.hidden_states, wrong_idle.hidden_states])

    for merge in (lambda: real.merge(wrong_idle), lambda: wrong_idle.merge(real)):
        with pytest.raises(ShapeContractError) as info:
            merge()
        message = str(info.value)
        assert "hidden_states" in message and "1728" in message and "256" in message
