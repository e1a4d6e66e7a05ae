"""actors/step_stream.py: the scheduler's step inputs cross the hop to a runner actor as deltas over
what the actor holds, and arrive exactly as sent; a message out of turn fails loudly; and in a real
engine's steps most fields travel as references while the running batch stays the same."""

from __future__ import annotations

import pickle

import pytest
import torch
from ray import cloudpickle

from actors import wire
from actors.step_stream import StreamError, StreamReceiver, StreamSender, held_field
from graphs import EngineConfig, SamplingParams, build_graph
from spec import BatchMeta, DraftInput
from wire_checks import assert_same, through_ray


@pytest.fixture(scope="module", autouse=True)
def packed():
    wire.register()


def step(seq_len: int, fixed: dict, draft: DraftInput) -> tuple[BatchMeta, DraftInput]:
    long = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    meta = BatchMeta(seq_lens=long(seq_len, seq_len + 3), kv_slots=torch.arange(2 * seq_len).view(2, seq_len),
                     prefill_lens=fixed["zeros"], prefill_tokens=fixed["none"], prefill_slots=fixed["none"],
                     next_token=long(-1, -1), scratch_slots=long(1, 2).view(2, 1), verify_slots=long(3, 4).view(2, 1),
                     temperature=fixed["temperature"], top_p=fixed["top_p"], top_k=fixed["top_k"],
                     seeds=fixed["seeds"], history=fixed["none"])
    return meta, draft


def draft_input(seed: int) -> DraftInput:
    g = torch.Generator().manual_seed(seed)
    return DraftInput(verified_id=torch.randint(0, 50, (2,), generator=g), hidden_states=torch.randn((2, 8), generator=g),
                      topk_p=torch.rand((2, 3), generator=g), topk_index=torch.randint(0, 50, (2, 3), generator=g))


# The BatchMeta fields `step` leaves to BatchMeta's defaults: fresh tensors each time, so they travel.
NEUTRAL = ["min_p", "prompt_lens", "num_output", "min_tokens", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "stop_ids", "bias_ids", "bias_values", "num_logprobs", "defer_draft"]


def fixed_fields() -> dict:
    return dict(zeros=torch.zeros(2, dtype=torch.long), none=torch.zeros((2, 0), dtype=torch.long),
                temperature=torch.tensor([0.0, 0.8]), top_p=torch.tensor([1.0, 0.9]), top_k=torch.tensor([0, 5]),
                seeds=torch.tensor([11, 12]))


def test_held_fields_arrive_as_the_tensors_the_actor_holds():
    sender, receiver, fixed = StreamSender(), StreamReceiver(), fixed_fields()
    first = step(4, fixed, draft_input(0))
    message = cloudpickle.dumps(sender.encode(*first), protocol=5)
    meta, draft = receiver.decode(pickle.loads(message))
    assert_same(first[0], meta)
    assert_same(first[1], draft)
    returned = draft_input(1)  # what the actor's step returned, and the scheduler reads
    receiver.returned(returned)
    as_read = through_ray(returned)
    sender.returned(as_read)

    second = step(5, fixed, as_read)  # the same sampling tensors, the returned DraftInput as it came back
    again = cloudpickle.dumps(sender.encode(*second), protocol=5)
    decoded = pickle.loads(again)
    held = {held_field(code)[:2] for code in decoded[2]}
    assert held == {(0, n) for n in ("prefill_lens", "prefill_tokens", "prefill_slots", "temperature", "top_p",
                                     "top_k", "seeds", "history")} | {(1, n) for n in draft.__dataclass_fields__}
    travelled = [n for part in decoded[3:] for n in part.__dataclass_fields__ if getattr(part, n) is not None]
    assert sorted(travelled) == sorted(["seq_lens", "kv_slots", "next_token", "scratch_slots", "verify_slots", *NEUTRAL])
    assert len(again) < len(message)
    meta2, draft2 = receiver.decode(decoded)
    assert_same(second[0], meta2)
    assert_same(returned, draft2)
    assert meta2.temperature is meta.temperature and meta2.history is meta.history  # what the actor held
    assert draft2.hidden_states is returned.hidden_states
    assert meta2.kv_slots.shape == (2, 5)  # what changed travelled

    third = step(6, fixed, draft_input(2))  # a DraftInput the scheduler built (requests joined): whole
    meta3, draft3 = receiver.decode(through_ray(sender.encode(*third)))
    assert_same(third[1], draft3)
    assert meta3.seeds is meta.seeds


def test_a_message_out_of_turn_fails_loudly_and_a_new_stream_starts_whole():
    sender, receiver, fixed = StreamSender(), StreamReceiver(), fixed_fields()
    receiver.decode(through_ray(sender.encode(*step(4, fixed, draft_input(0)))))
    sender.encode(*step(5, fixed, draft_input(0)))  # sent, never delivered (a step that failed on the way)
    with pytest.raises(StreamError, match="2 where 1 was due"):
        receiver.decode(through_ray(sender.encode(*step(6, fixed, draft_input(0)))))
    sender.reset()  # what the executor does after any failed step
    sent = step(7, fixed, draft_input(3))
    message = through_ray(sender.encode(*sent))
    assert message[2] == ()  # nothing held: the actor may hold nothing of a new stream
    meta, draft = receiver.decode(message)
    assert_same(sent[0], meta)
    assert_same(sent[1], draft)
    stranger = StreamReceiver()  # an actor that never saw the stream's start (a replacement)
    with pytest.raises(StreamError, match="never saw"):
        stranger.decode(through_ray(sender.encode(*step(8, fixed, draft_input(3)))))
    assert receiver.decode(pickle.loads(cloudpickle.dumps(sent, protocol=5)))[1].topk_p.shape == (2, 3)  # plain


def test_a_sender_not_holding_sends_every_field_whole():
    """bench.graph's transport lever: the same stream with nothing held."""
    sender, receiver, fixed = StreamSender(), StreamReceiver(), fixed_fields()
    sender.holding = False
    for seq in range(3):
        sent = step(4 + seq, fixed, draft_input(0))
        message = through_ray(sender.encode(*sent))
        assert message[2] == ()
        assert_same(sent[0], receiver.decode(message)[0])


class Loopback:
    """The colocated actor's hop without Ray: each step's inputs through a stream and Ray's pickler,
    the runners' outputs back through the pickler, as the compiled graph moves them."""

    def __init__(self, local):
        self.local, self.sender, self.receiver = local, StreamSender(), StreamReceiver()
        self.held: list[set] = []

    def execute(self, meta, draft_input):
        message = through_ray(self.sender.encode(meta, draft_input))
        self.held.append({held_field(code)[:2] for code in message[2]})
        ext, out = self.local.execute(*self.receiver.decode(message))
        self.receiver.returned(out)
        ext, out = through_ray((ext.for_scheduler(), out))
        self.sender.returned(out)
        return ext, out


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 30, 31, 30, 31]]
MAX_TOKENS = [24, 9, 17, 30, 12]  # requests leave at different steps


def run(engine, prompts, max_tokens) -> list[list[int]]:
    sched = engine.scheduler
    reqs = [sched.find(sched.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)))
            for p, m in zip(prompts, max_tokens)]
    while sched.has_unfinished():
        sched.step()
    return [r.output().token_ids for r in reqs]


def test_an_engine_stepping_through_the_stream_decodes_as_the_local_one(tiny_target, tiny_eagle3_shared):
    config = EngineConfig(model=str(tiny_target), speculative_algorithm="EAGLE3", draft_model=str(tiny_eagle3_shared),
                          eagle_topk=2, num_draft_tokens=6, num_steps=3, kv_slots=4096, cost_probe=False)
    plain = run(build_graph(config), PROMPTS, MAX_TOKENS)
    engine = build_graph(config)
    loop = engine.scheduler.executor = Loopback(engine.scheduler.executor)
    assert run(engine, PROMPTS, MAX_TOKENS) == plain
    # One request alone: after its prefill, every step holds the sampling inputs, the constant
    # columns and the DraftInput the actor returned.
    loop.held.clear()
    run(engine, PROMPTS[:1], [20])
    expected = {(0, n) for n in ("prefill_lens", "prefill_tokens", "prefill_slots", "next_token", "defer_draft",
                                 "stop_ids", "history", "temperature", "top_p", "top_k", "seeds", "min_p",
                                 "prompt_lens", "min_tokens", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty", "bias_ids", "bias_values", "num_logprobs")}
    expected |= {(1, n) for n in ("verified_id", "hidden_states", "topk_p", "topk_index")}
    decode_steps = loop.held[2:]
    assert decode_steps and all(held == expected for held in decode_steps), [sorted(expected - h) for h in decode_steps]
