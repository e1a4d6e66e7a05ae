"""Greedy speculative output equals plain decoding token for token, for every algorithm,
chain and tree, while requests join, leave and finish together; KV slots never leak."""

from __future__ import annotations

import itertools
import json

import pytest

from graphs import EngineConfig, SamplingParams, build_graph
from bench.random_models import make_eagle, make_eagle3, make_hot_vocab, make_llama

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 30, 31, 30, 31]]
# Different lengths so requests finish at different steps.
MAX_TOKENS = [24, 9, 17, 30, 12]

# (algorithm, draft fixture name, eagle_topk, num_draft_tokens, num_steps)
MATRIX = [
    ("NGRAM", None, 1, 4, 3),
    ("STANDALONE", "tiny_standalone", 1, 4, 3),
    ("STANDALONE", "tiny_standalone", 2, 6, 3),
    ("STANDALONE", "tiny_standalone_hot", 1, 4, 3),
    ("STANDALONE", "tiny_standalone_hot", 2, 6, 3),
    ("STANDALONE", "tiny_target", 1, 5, 4),  # the target as its own draft: everything accepted
    ("STANDALONE", "tiny_target", 3, 8, 3),
    ("EAGLE", "tiny_eagle", 1, 4, 3),
    ("EAGLE", "tiny_eagle", 2, 5, 3),
    ("EAGLE3", "tiny_eagle3_shared", 1, 4, 3),
    ("EAGLE3", "tiny_eagle3_shared", 4, 8, 3),
    ("EAGLE3", "tiny_eagle3_own", 1, 3, 2),
    ("EAGLE3", "tiny_eagle3_own", 2, 7, 4),
]


# Tests that count verify steps need every step to verify the full tree (no adaptive choice).
FIXED_TREES = {"adaptive_speculation": False}


def _engine(target, algorithm=None, draft=None, topk=1, n=4, steps=3, **kw):
    kw.setdefault("kv_slots", 4096)
    return build_graph(EngineConfig(
        model=str(target), speculative_algorithm=algorithm, draft_model=draft and str(draft),
        eagle_topk=topk, num_draft_tokens=n, num_steps=steps, **kw))


def _submit(sched, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list:
    """Add every request at once, greedy, each with its own max_tokens; their Request objects."""
    return [sched.find(sched.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)))
            for p, m in zip(prompts, max_tokens)]


def _run_all(engine, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    """Submit every request at once, each with its own max_tokens; run to completion."""
    sched = engine.scheduler
    reqs = _submit(sched, prompts, max_tokens)
    while sched.has_unfinished():
        sched.step()
    return [r.output() for r in reqs]


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = _engine(tiny_target)
    # One request at a time: the simplest possible schedule is the reference.
    return [_run_all(engine, [p], [m])[0].token_ids for p, m in zip(PROMPTS, MAX_TOKENS)]


@pytest.mark.parametrize("algorithm,draft,topk,n,steps", MATRIX)
def test_greedy_equals_plain_decoding(request, tiny_target, reference, algorithm, draft, topk, n, steps):
    draft_path = request.getfixturevalue(draft) if draft else None
    engine = _engine(tiny_target, algorithm, draft_path, topk, n, steps)
    # Every size in turn, plain steps included, whatever the timings say is best: the adaptive policy's
    # own choices follow the host's timing (a stall while the start-up probe times the trees made them
    # look too dear to try again, and the steps stayed plain), and are tested on simulated timings
    # (test_cost_model.py).
    policy = engine.scheduler.policy
    sizes = itertools.cycle(policy.buckets)
    policy.choose = lambda rids, context_tokens, tokens_left=None: policy._chosen(next(sizes)) if rids else 1
    free_before = engine.scheduler.num_free_slots
    outs = _run_all(engine)
    assert [o.token_ids for o in outs] == reference
    assert [o.num_output_tokens for o in outs] == MAX_TOKENS
    assert all(o.finish_reason == "length" for o in outs)
    assert engine.scheduler.num_free_slots == free_before
    # Drafts deferred over plain steps were caught up before the next tree.
    assert any(0 in o.draft_depths[:-1] and max(o.draft_depths[o.draft_depths.index(0):]) > 0 for o in outs)
    assert not engine.scheduler.prefilling


@pytest.mark.parametrize("algorithm,draft,topk,n,branch",
                         [("EAGLE3", "tiny_eagle3_shared", 4, 8, 3), ("STANDALONE", "tiny_standalone", 2, 6, 5)])
def test_ngram_branch_stays_lossless(request, tiny_target, reference, algorithm, draft, topk, n, branch):
    engine = _engine(tiny_target, algorithm, request.getfixturevalue(draft), topk, n, 3, ngram_branch=branch)
    free_before = engine.scheduler.num_free_slots
    assert [o.token_ids for o in _run_all(engine)] == reference
    assert engine.scheduler.num_free_slots == free_before


# Thresholds at which these random drafts' steps verify trees of several widths (2-4 / 6-8 / 3-5 nodes).
@pytest.mark.parametrize("algorithm,draft,topk,n,prob", [("EAGLE3", "tiny_eagle3_shared", 1, 4, 0.05),
                                                          ("EAGLE3", "tiny_eagle3_shared", 4, 8, 0.03),
                                                          ("STANDALONE", "tiny_standalone", 2, 6, 0.05)])
def test_min_path_prob_stays_lossless(request, tiny_target, reference, algorithm, draft, topk, n, prob):
    engine = _engine(tiny_target, algorithm, request.getfixturevalue(draft), topk, n, 3, min_path_prob=prob)
    free_before = engine.scheduler.num_free_slots
    assert [o.token_ids for o in _run_all(engine)] == reference
    assert engine.scheduler.num_free_slots == free_before


def test_min_path_prob_verifies_only_drafts_that_likely(tiny_target, reference):
    """The target as its own draft accepts whatever it verifies, so the verify steps count the
    drafts kept: all of them at 0, none (plain decoding, one token a step) when no draft is that
    likely, and in between at a threshold among its probabilities."""
    def steps(prob):
        outs = _run_all(_engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4, min_path_prob=prob, **FIXED_TREES))
        assert [o.token_ids for o in outs] == reference
        return sum(o.num_verify_steps for o in outs)

    full, plain = sum(1 + -(-(m - 1) // 5) for m in MAX_TOKENS), sum(MAX_TOKENS)
    assert steps(0.0) == full
    assert steps(0.999) == plain
    assert full < steps(0.2) < plain


def test_full_acceptance_when_draft_is_target(tiny_target, reference):
    engine = _engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4, **FIXED_TREES)
    outs = _run_all(engine)
    assert [o.token_ids for o in outs] == reference
    # 1 prefill token, then 5 tokens (4 drafts + bonus) per verify step.
    assert [o.num_verify_steps for o in outs] == [1 + -(-(m - 1) // 5) for m in MAX_TOKENS]


def test_hot_vocab_draft_proposes_target_ids(tiny_target, tiny_dir, reference):
    """The target as its own draft, proposing only a hot vocabulary: holding every id the outputs
    use, it is accepted in full (its draft rows map back to the right target ids); without some
    of them, less is accepted and the output is still the target's own."""
    used = sorted({t for out in reference for t in out})
    assert len(used) < 64  # the hot vocabulary is a strict subset, so d2t is not the identity

    def verify_steps(name, ids):
        outs = _run_all(_engine(tiny_target, "STANDALONE", make_hot_vocab(tiny_dir / name, tiny_target, ids), 1, 5, 4, **FIXED_TREES))
        assert [o.token_ids for o in outs] == reference
        return [o.num_verify_steps for o in outs]

    full = [1 + -(-(m - 1) // 5) for m in MAX_TOKENS]
    assert verify_steps("target_hot_used", used) == full
    assert sum(verify_steps("target_hot_partial", used[::2])) > sum(full)


def _limited_steps(engine, after_prefill=lambda reqs: None) -> tuple[list, list[tuple[int, int, int]]]:
    """Run every request at once; per decode step and request (running batch, tokens left, tokens gained).
    `after_prefill(requests)` runs once every request has joined."""
    sched = engine.scheduler
    reqs = _submit(sched)
    sched.step()  # prefill: every request joins
    after_prefill(reqs)
    steps = []
    while sched.has_unfinished():
        before = {id(r): len(r.output_ids) for r in sched.running}
        sched.step()
        steps += [(len(before), r.max_new_tokens - before[id(r)], len(r.output_ids) - before[id(r)])
                  for r in reqs if id(r) in before]
    return reqs, steps


@pytest.mark.parametrize("limits,nodes", [
    ({"disable_by_batch_size": 2}, lambda batch: 5 if batch <= 2 else 1),
    ({"verify_budget": 8}, lambda batch: max(1, min(5, 8 // batch))),
    ({"verify_budget": 8, "disable_by_batch_size": 3}, lambda batch: 1 if batch > 3 else max(1, min(5, 8 // batch))),
])
def test_batch_limits_shrink_trees_as_the_batch_grows(tiny_target, reference, limits, nodes):
    """The target as its own draft accepts every node, so each step commits exactly as many tokens
    per request as its tree kept: 5 in a small batch, fewer as the batch grows, 1 (the root)
    above the cutoff; output stays the target's own and no KV slot leaks."""
    engine = _engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4, adaptive_speculation=False, **limits)
    free_before = engine.scheduler.num_free_slots
    reqs, steps = _limited_steps(engine)
    assert [r.output().token_ids for r in reqs] == reference
    assert engine.scheduler.num_free_slots == free_before
    assert all(gained == min(nodes(batch), left) for batch, left, gained in steps)
    assert {nodes(batch) for batch, _, _ in steps} > {1}  # the run saw both cut and full trees


def test_deferred_draft_catches_up_exactly(tiny_target, reference):
    """Plain steps defer the draft's extend; the catch-up (here also forced every 2 waiting tokens)
    must leave the draft's KV as step-by-step extends would: the target as its own draft then accepts
    its whole tree at every step that drafts, after any number of plain steps."""
    engine = _engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4, disable_by_batch_size=2, **FIXED_TREES)
    engine.scheduler.executor.drafter.max_pending = 2
    reqs, steps = _limited_steps(engine)
    assert [r.output().token_ids for r in reqs] == reference
    assert all(gained == (min(5, left) if batch <= 2 else 1) for batch, left, gained in steps)


@pytest.mark.parametrize("algorithm,draft,steps", [("STANDALONE", "tiny_target", 4), ("EAGLE3", "tiny_eagle3_shared", 3)])
def test_prompts_joining_a_plain_load_defer_their_draft_prefill(request, tiny_target, reference, algorithm, draft, steps):
    """Prompts that join a load decoding plain (above disable_by_batch_size) leave the draft's prefill
    waiting: no draft forward runs over them. The first tree drafted for a request catches its draft
    up over its prompt and the plain steps' tokens in one pass; the target as its own draft then
    accepts its whole tree, as after a full prefill, and output stays the target's own."""
    engine = _engine(tiny_target, algorithm, request.getfixturevalue(draft), 1, 5, steps,
                     disable_by_batch_size=2, **FIXED_TREES)
    sched = engine.scheduler

    def waiting(reqs):  # every prompt prefilled into a load of 5 requests, which decodes plain
        assert len(sched.executor.drafter._pending) == sum(map(len, PROMPTS))
        assert sched.policy.lag == {r.rid: len(p) for r, p in zip(reqs, PROMPTS)}

    reqs, steps = _limited_steps(engine, waiting)
    assert [r.output().token_ids for r in reqs] == reference
    if draft == "tiny_target":
        assert all(gained == (min(5, left) if batch <= 2 else 1) for batch, left, gained in steps)


def test_the_drafter_times_each_catch_up_for_the_policy(tiny_target, tiny_eagle3_shared, reference):
    """Each tree that resumes drafting reports its catch-up on the step's result, as the drafter ran it:
    exactly the tokens its requests left waiting (their deferred prompts and plain steps' tokens) and the
    seconds that forward took. The tree-size policy prices catch-ups from these, never inferring them
    from whole steps."""
    engine = _engine(tiny_target, "EAGLE3", tiny_eagle3_shared, 1, 5, 3, disable_by_batch_size=2, **FIXED_TREES)
    sched = engine.scheduler
    caught_up, commit = [], sched.commit

    def recording(plan, ext, draft_input, seconds=None):
        if plan.kind == "decode" and plan.meta.verify_slots.shape[1] > 1:
            caught_up.append((sum(sched.policy.lag.get(r.rid, 0) for r in plan.requests),
                              ext.catch_up_tokens, ext.catch_up_s))
        return commit(plan, ext, draft_input, seconds)

    sched.commit = recording
    reqs, _ = _limited_steps(engine)
    assert [r.output().token_ids for r in reqs] == reference
    resumed = [c for c in caught_up if c[0] > 0]
    assert resumed and all(tokens == waited and seconds > 0 for waited, tokens, seconds in resumed)
    assert all(tokens == 0 for waited, tokens, _ in caught_up if waited == 0)
    assert sched.policy.costs.predict_catch_up(100) > 0


def test_a_burst_of_prompts_defers_its_draft_prefill_from_the_first_chunk(tiny_target, reference):
    """Prompts that arrive together decode together: the first one prefilled (one chunk a step here)
    already counts the others still queued, so a burst above disable_by_batch_size leaves the draft's
    prefill waiting from its first chunk; output stays the target's own."""
    engine = _engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4, disable_by_batch_size=2,
                     max_num_batched_tokens=len(PROMPTS[0]), prefill_order="fcfs", **FIXED_TREES)  # the first alone
    sched = engine.scheduler
    reqs = _submit(sched)
    sched.step()
    assert len(sched.waiting) == len(PROMPTS) - 1  # the rest of the burst is still queued
    assert len(sched.executor.drafter._pending) == len(PROMPTS[0])
    assert sched.policy.lag == {reqs[0].rid: len(PROMPTS[0])}
    while sched.has_unfinished():
        sched.step()
    assert [r.output().token_ids for r in reqs] == reference


def test_requests_sharing_a_waiting_cached_prefix_catch_up_together(tiny_target, caplog):
    """A request that ran only plain steps leaves its draft KV waiting, and the prefix cache keeps its
    tokens; two requests hitting that prefix in one step both end their cached slots in those waiting
    tokens. The step catches both up (no failed step rerun request by request), and the target as its
    own draft then accepts its whole tree at every step."""
    engine = _engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4, disable_by_batch_size=2, **FIXED_TREES)
    sched = engine.scheduler
    first = [[1, 2, 3, 4, 5, 6, 7, 8], [20, 21], [30, 31]]
    ran_plain = _run_all(engine, first, [3, 3, 3])  # a load of 3 decodes plain: no draft forward ran
    assert len(sched.executor.drafter._pending) > 0
    known = first[0] + ran_plain[0].token_ids
    later = [known + [40], known + [41, 42]]
    reference = [_run_all(_engine(tiny_target), [p], [11])[0].token_ids for p in later]
    hits = sched.cache.hit_tokens
    outs = _run_all(engine, later, [11, 11])
    assert sched.cache.hit_tokens - hits >= 2 * (len(known) - 1)
    assert [o.token_ids for o in outs] == reference
    assert "step failed" not in caplog.text
    assert [o.num_verify_steps for o in outs] == [1 + 2, 1 + 2]  # the prefill's token, then two full trees of 5


@pytest.mark.parametrize("algorithm,draft,topk,n", [("EAGLE3", "tiny_eagle3_shared", 4, 8), ("EAGLE", "tiny_eagle", 2, 5),
                                                     ("NGRAM", None, 1, 5)])
def test_batch_limits_stay_lossless(request, tiny_target, reference, algorithm, draft, topk, n):
    draft_path = request.getfixturevalue(draft) if draft else None
    engine = _engine(tiny_target, algorithm, draft_path, topk, n, 3, verify_budget=9, disable_by_batch_size=4,
                     adaptive_speculation=False)
    free_before = engine.scheduler.num_free_slots
    reqs, steps = _limited_steps(engine)
    assert [r.output().token_ids for r in reqs] == reference
    assert engine.scheduler.num_free_slots == free_before
    assert all(gained == 1 for batch, _, gained in steps if batch > 4)


@pytest.mark.parametrize("algorithm,draft", [("EAGLE3", "tiny_eagle3_own"), ("STANDALONE", "tiny_standalone"), ("NGRAM", None)])
def test_requests_join_mid_flight(request, tiny_target, reference, algorithm, draft):
    draft_path = request.getfixturevalue(draft) if draft else None
    engine = _engine(tiny_target, algorithm, draft_path, 2 if draft else 1, 5, 3)
    sched = engine.scheduler
    free_before = sched.num_free_slots
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    first = [sched.add_request(PROMPTS[i], params[i]) for i in (0, 1)]
    for _ in range(3):
        sched.step()
    late = [sched.add_request(PROMPTS[i], params[i]) for i in (2, 3)]
    sched.step()
    last = sched.add_request(PROMPTS[4], params[4])
    reqs = [sched.find(r) for r in first + late + [last]]
    while sched.has_unfinished():
        sched.step()
    assert [r.output().token_ids for r in reqs] == reference
    assert sched.num_free_slots == free_before


@pytest.mark.parametrize("algorithm,draft", [("EAGLE3", "tiny_eagle3_shared"), ("STANDALONE", "tiny_target")])
def test_all_requests_finish_in_the_same_step(request, tiny_target, reference, algorithm, draft):
    """After the batch empties at verify, the next steps run on idle inputs without error."""
    engine = _engine(tiny_target, algorithm, request.getfixturevalue(draft))
    outs = _run_all(engine, PROMPTS[:3], [6, 6, 6])
    assert [o.token_ids for o in outs] == [ref[:6] for ref in reference[:3]]
    assert engine.scheduler.draft_input.num_requests == 0
    assert engine.scheduler.step() == []  # nothing to do: no crash
    outs = _run_all(engine, PROMPTS[3:], MAX_TOKENS[3:])  # and the engine keeps serving
    assert [o.token_ids for o in outs] == reference[3:]


def test_kv_budget_makes_requests_wait(tiny_target, reference):
    """A KV pool that fits about one request at a time: the rest wait, all finish, nothing leaks."""
    engine = _engine(tiny_target, "NGRAM", kv_slots=80)
    outs = _run_all(engine)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.num_free_slots == 80


def test_max_running_requests(tiny_target, reference):
    engine = _engine(tiny_target, "NGRAM", max_running_requests=2)
    sched = engine.scheduler
    reqs = _submit(sched)
    peak = 0
    while sched.has_unfinished():
        sched.step()
        peak = max(peak, len(sched.running))
    assert peak == 2
    assert [r.output().token_ids for r in reqs] == reference
    assert sched.num_free_slots == 4096


# ---- logits processors: verification applies them per node exactly as plain decoding does ----

PROCESSED = dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                 logit_bias={5: 2.0, 7: -1.5}, min_tokens=6, stop_token_ids=[11])
PROCESSED_MATRIX = [
    ("NGRAM", None, 1, 4, 3),
    ("STANDALONE", "tiny_standalone", 1, 4, 3),
    ("STANDALONE", "tiny_target", 3, 8, 3),
    ("EAGLE3", "tiny_eagle3_shared", 1, 4, 3),
    ("EAGLE3", "tiny_eagle3_shared", 4, 8, 3),
]


def _run_params(engine, params: list[SamplingParams], prompts=PROMPTS) -> list:
    sched = engine.scheduler
    reqs = [sched.find(sched.add_request(p, sp)) for p, sp in zip(prompts, params)]
    while sched.has_unfinished():
        sched.step()
    return [r.output() for r in reqs]


def _processed_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, **PROCESSED) for m in MAX_TOKENS]


@pytest.fixture(scope="module")
def processed_reference(tiny_target):
    engine = _engine(tiny_target)
    return [_run_params(engine, [sp], [p])[0] for p, sp in zip(PROMPTS, _processed_params())]


def test_processors_change_greedy_output(processed_reference, reference):
    """The processed reference is not plain greedy (the lossless tests below would be vacuous)."""
    assert [o.token_ids for o in processed_reference] != reference
    assert all(len(o.token_ids) >= 6 for o in processed_reference)  # min_tokens held every stop back


@pytest.mark.parametrize("algorithm,draft,topk,n,steps", PROCESSED_MATRIX)
def test_processors_stay_lossless(request, tiny_target, processed_reference, algorithm, draft, topk, n, steps):
    # Full trees every step: the processors must see drafted tokens, whatever the adaptive policy
    # would make of this machine's timings (a loaded box had it decode plainly throughout).
    engine = _engine(tiny_target, algorithm, request.getfixturevalue(draft) if draft else None, topk, n, steps,
                     adaptive_speculation=False)
    free_before = engine.scheduler.num_free_slots
    outs = _run_params(engine, _processed_params())
    assert [o.token_ids for o in outs] == [o.token_ids for o in processed_reference]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in processed_reference]
    if draft == "tiny_target":
        assert sum(sum(o.accept_lens) for o in outs) > 0
    assert engine.scheduler.num_free_slots == free_before


def test_stop_token_ids_end_the_output_after_min_tokens(tiny_target, reference):
    """A stop id ends the output (finish "stop", its text left out); min_tokens holds it back."""
    engine = _engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4)
    stop = reference[0][3]
    first = reference[0].index(stop)
    out = _run_params(engine, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                              stop_token_ids=[stop])], PROMPTS[:1])[0]
    assert out.token_ids == reference[0][: first + 1] and out.finish_reason == "stop"
    assert f"w{stop}" not in out.text.split()
    held = _run_params(engine, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[stop], min_tokens=first + 2)], PROMPTS[:1])[0]
    assert stop not in held.token_ids[: first + 2] and len(held.token_ids) > first + 1


def test_logprobs_are_the_targets_log_softmax(tiny_target):
    """Logprobs returned through verification equal log_softmax of transformers' logits on prompt +
    output. The target drafts for itself: greedy requests accept every draft; the sampled one
    first in the batch rejects some, so the others' rows sit at other offsets of the logits."""
    import torch
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4, **FIXED_TREES)
    params = [SamplingParams(max_tokens=10, temperature=1.5, seed=3, ignore_eos=True, logprobs=0,
                             repetition_penalty=1.2),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)]
    outs = _run_params(engine, params, [PROMPTS[2], PROMPTS[0], PROMPTS[1]])
    assert outs[2].logprobs is None and sum(outs[1].accept_lens) > 0
    assert outs[0].num_verify_steps > 1 + -(-(10 - 1) // 5)  # the sampled one rejected some drafts
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    for prompt, out, k in ((PROMPTS[2], outs[0], 0), (PROMPTS[0], outs[1], 3)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
        ref = logits[len(prompt) - 1 : -1].log_softmax(-1)  # (T, V): the distribution of each output token
        assert len(out.logprobs) == len(out.token_ids)
        got = torch.tensor([lp for lp, _ in out.logprobs])
        assert torch.allclose(got, ref[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)], atol=1e-4)
        for (_, top), row in zip(out.logprobs, ref):
            values, ids = row.topk(k)
            assert [t for t, _ in top] == ids.tolist()
            assert torch.allclose(torch.tensor([v for _, v in top]).reshape(-1), values, atol=1e-4)


def test_min_p_one_samples_the_top_token(tiny_target, reference):
    """min_p = 1 keeps only the most likely token: sampling (through prefill and verification)
    gives greedy's output."""
    engine = _engine(tiny_target, "STANDALONE", tiny_target, 1, 5, 4)
    params = [SamplingParams(max_tokens=m, temperature=1.5, seed=i, min_p=1.0, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    assert [o.token_ids for o in _run_params(engine, params)] == reference


# --------------------------------------------------------------------------- bring your own model
# Qwen3 and Mistral targets with drafts in the layouts they are published in (bench/random_models.py
# names the source of each layout), shrunk; greedy output must be the target's own.

BYO_PROMPTS, BYO_MAX_TOKENS = PROMPTS[:3], [14, 9, 11]


@pytest.fixture(scope="module")
def byo_targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    return {
        # Qwen3 dense: per-head q/k norm, tied embeddings (as Qwen3-4B), sliding window off.
        "qwen3": make_llama(root / "qwen3", arch="qwen3", layers=4, seed=21, use_sliding_window=False,
                            max_window_layers=4),
        # Mistral (v0.3: no sliding window), one KV head, untied.
        "mistral": make_llama(root / "mistral", arch="mistral", layers=4, kv_heads=1, tie=False, seed=22,
                              sliding_window=None),
    }


@pytest.fixture(scope="module")
def byo_reference(byo_targets):
    return {name: [o.token_ids for o in _run_all(_engine(folder), BYO_PROMPTS, BYO_MAX_TOKENS)]
            for name, folder in byo_targets.items()}


def _specforge_qwen3(folder, target):
    """SpecForge `configs/qwen3-4b-eagle3.json`, shrunk: as wide as the target, no
    target_hidden_size, draft_vocab_size at top level, tie_word_embeddings true, no eagle_config;
    the trained head carries its embeddings, d2t and t2d, names bare with `midlayer.*`."""
    return make_eagle3(folder, target, hidden=64, draft_vocab=32, own_embeddings=True, declare_target_hidden=False,
                       aux_ids_at="top", tie_word_embeddings=True, max_window_layers=36, use_sliding_window=False,
                       sliding_window=None, bos_token_id=None, eos_token_id=62)


def _eagle_authors_qwen3(folder, target):
    """yuhuili/EAGLE3-*: `midlayer.*`, d2t and t2d, no embeddings (the target's), no target_hidden_size."""
    return make_eagle3(folder, target, hidden=64, draft_vocab=32, declare_target_hidden=False, aux_ids_at="top",
                       seed=3)


def _sglang_prefixed_mistral(folder, target):
    """SGLang's module names (`model.midlayer.*`, `model.fc`), a narrower head with its own
    embeddings, aux layers in `eagle_config`, the whole vocabulary without d2t/t2d."""
    return make_eagle3(folder, target, hidden=32, prefix="model.", own_embeddings=True, aux_layer_ids=[0, 1, 2],
                       seed=4)


def _vllm_layers_mistral(folder, target):
    """vLLM's names (`layers.0.*`), aux layer ids at the top level (as the speculators configs),
    an identity d2t and no LM head (the target's, over the whole vocabulary)."""
    return make_eagle3(folder, target, hidden=64, layer="layers.0", aux_ids_at="top", aux_layer_ids=[1, 2],
                       lm_head=False, maps=True, seed=5)


def _eagle1_authors_mistral(folder, target):
    """The EAGLE authors' EAGLE-1/2 heads: the target's config with `LlamaForCausalLM`, fc.* and layers.0.*."""
    return make_eagle(folder, target, architectures=("LlamaForCausalLM",), seed=6)


def _qwen3_standalone(folder, target):
    """A smaller Qwen3 LM sharing the target's tokenizer (vocab and eos)."""
    return make_llama(folder, arch="qwen3", hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, seed=23,
                      use_sliding_window=False)


BYO_MATRIX = [
    ("qwen3", _specforge_qwen3, "EAGLE3", 2, 6, 3),
    ("qwen3", _eagle_authors_qwen3, "EAGLE3", 1, 4, 3),
    ("qwen3", _qwen3_standalone, "STANDALONE", 2, 5, 3),
    ("mistral", _sglang_prefixed_mistral, "EAGLE3", 1, 4, 3),
    ("mistral", _vllm_layers_mistral, "EAGLE3", 2, 6, 3),
    ("mistral", _eagle1_authors_mistral, "EAGLE", 1, 4, 3),
]


@pytest.mark.parametrize("target,make_draft,algorithm,topk,n,steps", BYO_MATRIX,
                         ids=[f"{case[0]}-{case[1].__name__.strip('_')}-{case[3]}" for case in BYO_MATRIX])
def test_published_layouts_are_lossless(byo_targets, byo_reference, tmp_path, target, make_draft, algorithm, topk,
                                        n, steps):
    draft = make_draft(tmp_path / "draft", byo_targets[target])
    engine = _engine(byo_targets[target], algorithm, draft, topk, n, steps)
    free_before = engine.scheduler.num_free_slots
    outs = _run_all(engine, BYO_PROMPTS, BYO_MAX_TOKENS)
    assert [o.token_ids for o in outs] == byo_reference[target]
    assert engine.scheduler.num_free_slots == free_before


@pytest.mark.parametrize("field,value", [("eos_token_id", 5), ("vocab_size", 80)])
def test_standalone_with_another_tokenizer_is_refused(byo_targets, tmp_path, field, value):
    """A standalone draft must share the target's tokenizer: refused at startup naming the field."""
    draft = make_llama(tmp_path / "other", arch="qwen3", hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64,
                       use_sliding_window=False, **{"vocab_size": 80} if field == "vocab_size" else {})
    if field == "eos_token_id":
        config = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps(dict(config, eos_token_id=value)))
    with pytest.raises(ValueError, match=rf"^{field}: STANDALONE draft has {field} {value}, target has"):
        _engine(byo_targets["qwen3"], "STANDALONE", draft)
