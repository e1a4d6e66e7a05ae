"""actors/wire.py: step batches sent packed through Ray's pickler arrive exactly as sent
(every field's values, dtype and shape; None stays None; idle zero-row inputs), and own
their memory (the channel buffer they came from is reused by the next step)."""

from __future__ import annotations

import copy
import os
import pickle
import threading
from dataclasses import fields

import pytest
import torch
from ray import cloudpickle

from actors import wire
from spec import BatchMeta, DraftExtendInput, DraftInput, HiddenStateSpec, VerifyInput
from wire_checks import assert_same, through_ray


@pytest.fixture(scope="module", autouse=True)
def packed():
    wire.register()


def batches() -> list:
    g = torch.Generator().manual_seed(0)
    b, n = 3, 4
    hidden = HiddenStateSpec(24, torch.bfloat16)
    meta = BatchMeta(
        seq_lens=torch.tensor([5, 9, 2]), kv_slots=torch.randint(0, 100, (b, 9), generator=g),
        prefill_lens=torch.zeros(b, dtype=torch.long), prefill_tokens=torch.zeros((b, 0), dtype=torch.long),
        prefill_slots=torch.zeros((b, 0), dtype=torch.long), next_token=torch.full((b,), -1),
        scratch_slots=torch.arange(b * 3).reshape(b, 3), verify_slots=torch.arange(b * n).reshape(b, n),
        temperature=torch.tensor([0.0, 0.7, 1.3]), top_p=torch.ones(b), top_k=torch.tensor([0, 5, 0]),
        seeds=torch.tensor([1, 2, 3]), history=torch.randint(-1, 50, (b, 7), generator=g),
        bias_values=torch.randn((b, 2), generator=g, dtype=torch.float64).float(),
    )
    draft = DraftInput(verified_id=torch.tensor([7, 8, 9]),
                       hidden_states=torch.randn((b, 24), generator=g).to(torch.bfloat16),
                       topk_p=torch.rand((b, 2), generator=g), topk_index=torch.randint(0, 50, (b, 2), generator=g))
    tree = torch.rand((b, n, n), generator=g) > 0.5
    verify = VerifyInput(draft_tokens=torch.randint(0, 50, (b, n), generator=g),
                         parents=torch.tensor([[-1, 0, 0, 1]] * b), positions=torch.arange(b * n).reshape(b, n),
                         tree_mask=tree)
    ext = DraftExtendInput(tokens=torch.arange(6), next_tokens=torch.arange(1, 7), positions=torch.arange(6),
                           slots=torch.arange(6) * 3, hidden_states=torch.randn((6, 48), generator=g),
                           extend_lens=torch.tensor([2, 3, 1]), accept_lens=torch.tensor([1, 2, 0]),
                           logprobs=torch.randn(6, generator=g), top_logprobs=torch.randn((6, 0), generator=g),
                           top_ids=torch.zeros((6, 0), dtype=torch.long), catch_up_tokens=40, catch_up_s=0.0016)
    idle = [BatchMeta.create_idle(3, n), DraftInput.create_idle(hidden, 2), DraftInput.create_idle(None, 0),
            VerifyInput.create_idle(n), DraftExtendInput.create_idle(None)]
    return [meta, draft, verify, ext, ext.for_scheduler(), *idle]


@pytest.mark.parametrize("index", range(len(batches())))
def test_batches_arrive_as_sent(index):
    sent = batches()[index]
    data = cloudpickle.dumps(sent, protocol=5)
    assert b"actors.wire" in data  # Ray's pickler took the packed path
    assert_same(sent, pickle.loads(data))


def test_a_step_input_tuple_and_strided_tensors_arrive_as_sent():
    meta, draft = batches()[:2]
    draft.topk_p = torch.rand((2, 3)).t()  # (3, 2), not contiguous
    got_meta, got_draft = through_ray((meta, draft))
    assert_same(meta, got_meta)
    assert_same(draft, got_draft)


def test_received_tensors_own_writable_memory():
    sent = batches()[0]
    data = cloudpickle.dumps(sent, protocol=5)
    got, again = pickle.loads(data), pickle.loads(data)
    got.seq_lens += 100  # in place, as a runner may
    got.kv_slots.zero_()
    assert_same(sent, again)  # neither the sender's tensors nor another read changed
    assert torch.equal(got.seq_lens, sent.seq_lens + 100)
    assert torch.equal(got.history, sent.history)  # neighbours in the buffer untouched


def test_every_dtype_and_shape_arrives_as_sent():
    """Fields of every packed dtype, odd lengths (a run of one dtype must leave the next aligned), 0-d
    and empty tensors, and a dtype that is not packed (sent by Ray's pickler) in one batch."""
    g = torch.Generator().manual_seed(1)
    sent = copy.copy(batches()[0])
    values = [torch.randint(-9, 9, (3, 5), generator=g, dtype=dtype) for dtype in (torch.int16, torch.int8)]
    values.append(torch.randint(0, 200, (3, 5), generator=g, dtype=torch.uint8))
    values += [torch.randn((3, 7), generator=g, dtype=dtype) for dtype in (torch.float64, torch.float16, torch.bfloat16)]
    values += [torch.tensor(7, dtype=torch.int32), torch.rand(3, generator=g) > 0.5, torch.zeros((0, 3)),
               torch.randn(3, generator=g, dtype=torch.complex64)]
    names = [f.name for f in fields(sent) if f.name not in ("seq_lens", "kv_slots")]
    for name, value in zip(names, values):
        setattr(sent, name, value)
    got = through_ray(sent)
    assert_same(sent, got)
    assert torch.equal(got.seq_lens, sent.seq_lens) and torch.equal(got.kv_slots, sent.kv_slots)


def test_packing_a_large_batch_starts_no_thread_team():
    """Ray packs and unpacks on its own thread in the actor: a torch op there over more than 32k elements
    would start a second OpenMP team beside the compute thread's, and with more OpenMP threads than CPUs
    libgomp stops spinning between regions, which slows every region of the forward. Two torch threads, as
    an actor on two CPUs has (other tests leave the process at one, and a new thread takes the process's)."""
    g = torch.Generator().manual_seed(2)
    large = [DraftInput(verified_id=torch.arange(64), hidden_states=torch.randn((64, 1024), generator=g).to(dtype),
                        topk_p=torch.rand((64, 4), generator=g), topk_index=torch.zeros((64, 4), dtype=torch.long))
             for dtype in (torch.float32, torch.bfloat16)]
    seen = {}

    def on_a_fresh_thread():
        before = len(os.listdir("/proc/self/task"))
        seen["got"] = [through_ray(batch) for batch in large]
        seen["added"] = len(os.listdir("/proc/self/task")) - before

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        thread = threading.Thread(target=on_a_fresh_thread)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    assert seen["added"] == 0
    for sent, got in zip(large, seen["got"]):
        assert_same(sent, got)
