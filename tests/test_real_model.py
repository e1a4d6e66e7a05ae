"""Lossless speculative decoding on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest

from graphs import EngineConfig, SamplingParams, build_graph
from models.loader import resolve_model
from bench.random_models import make_eagle3, make_llama

pytestmark = pytest.mark.integration

CONVERSATIONS = [
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "List three uses of a paperclip."}],
    [{"role": "user", "content": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"}],
]
MAX_TOKENS = [32, 20, 27]
DEFAULT = "smollm2-135m-instruct"
# Lower bounds on tokens per verify step of the shipped drafts on CONVERSATIONS (not tuned on
# them: well below what their READMEs measure on held-out prompts).
SHIPPED_MIN_ACCEPTANCE = {"smollm2-135m-instruct-eagle3": 1.5, "smollm2-135m-instruct-standalone": 1.5}


def _run(engine):
    sched = engine.scheduler
    rids = [sched.add_request(engine.encode_chat(c), SamplingParams(max_tokens=m, temperature=0.0))
            for c, m in zip(CONVERSATIONS, MAX_TOKENS)]
    reqs = [sched.find(r) for r in rids]
    while sched.has_unfinished():
        sched.step()
    return [r.output() for r in reqs]


def _engine(**kw):
    # No start-up cost probe: it leaves nothing behind that outputs could depend on
    # (test_cost_model.py::test_engine_start_probes_costs_and_leaves_nothing_behind), and on the real
    # model it is several seconds of each engine's build on a 2-core CPU.
    return build_graph(EngineConfig(model=DEFAULT, kv_slots=2048, cost_probe=False, **kw))


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_drafts")
    target = resolve_model(DEFAULT)
    return {
        # Random heads: correct but rarely accepted; what matters here is exactness.
        "eagle3_576": make_eagle3(root / "eagle3_576", target, hidden=576, heads=9, kv_heads=3),
        "eagle3_256": make_eagle3(root / "eagle3_256", target, hidden=256, heads=4, kv_heads=2,
                                  draft_vocab=8192, own_embeddings=True),
        # A stand-in for a small LM with the target's tokenizer: its special ids are the target's.
        "standalone_128": make_llama(root / "standalone_128", vocab_size=49152, hidden=128, layers=2, heads=2,
                                     kv_heads=1, intermediate=256, max_pos=8192, seed=3, std=0.02,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=2),
        "target": target,
    }


@pytest.fixture(scope="module")
def reference():
    engine = _engine()
    outs = _run(engine)
    assert engine.scheduler.num_free_slots == 2048
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("algorithm,draft,topk,n", [
    ("NGRAM", None, 1, 4),
    ("EAGLE3", "eagle3_576", 1, 4),
    ("EAGLE3", "eagle3_256", 4, 8),
    ("STANDALONE", "standalone_128", 1, 4),
    ("STANDALONE", "target", 2, 6),
    # The drafts shipped in drafts/, by registry name.
    ("EAGLE3", "smollm2-135m-instruct-eagle3", 1, 4),
    ("EAGLE3", "smollm2-135m-instruct-eagle3", 4, 8),
    ("STANDALONE", "smollm2-135m-instruct-standalone", 1, 4),
])
def test_greedy_matches_plain_decoding(drafts, reference, algorithm, draft, topk, n):
    # The target as its own draft checks that drafts line up with the target's positions; adaptive
    # speculation would rightly find a draft as costly as the target not worth full trees here.
    policy = dict(adaptive_speculation=False) if draft == "target" else {}
    engine = _engine(speculative_algorithm=algorithm, draft_model=draft and str(drafts.get(draft, draft)),
                     eagle_topk=topk, num_draft_tokens=n, **policy)
    outs = _run(engine)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.num_free_slots == 2048
    if draft == "target":  # a perfect draft: several tokens per verify step
        assert all(_drafted_acceptance([o]) > 2.0 for o in outs)
    if draft in SHIPPED_MIN_ACCEPTANCE:  # a trained draft: well above the 1.0 of a useless one
        assert _drafted_acceptance(outs) > SHIPPED_MIN_ACCEPTANCE[draft]


def _drafted_acceptance(outs) -> float:
    """Tokens per verify step over the decode steps that drafted: adaptive speculation also takes
    plain steps (measuring, or where drafts do not pay), whose one token says nothing of the draft."""
    accepted = [a for o in outs for a, depth in zip(o.accept_lens, o.draft_depths) if depth > 0]
    assert accepted, "no decode step drafted"
    return 1 + sum(accepted) / len(accepted)


def test_chunks_preemption_and_cache_hits_stay_lossless(reference):
    """The shipped EAGLE-3 tree under a 16-token prefill budget, a 160-slot pool (preemptions)
    and the prefix cache: first turns equal plain decoding, and second turns, which find their
    first turn cached, equal a cache-less plain run."""
    draft = dict(speculative_algorithm="EAGLE3", draft_model="smollm2-135m-instruct-eagle3", eagle_topk=4,
                 num_draft_tokens=8)
    engine = build_graph(EngineConfig(model=DEFAULT, kv_slots=160, max_num_batched_tokens=16, **draft))
    outs = _run(engine)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.stats.preemptions > 0
    second = [c + [{"role": "assistant", "content": o.text}, {"role": "user", "content": "Shorter, please."}]
              for c, o in zip(CONVERSATIONS, outs)]
    plain = _engine(prefix_cache=False)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    assert [o.token_ids for o in engine.chat(second, params)] == [o.token_ids for o in plain.chat(second, params)]
    assert engine.scheduler.cache.hit_tokens > sum(len(o.token_ids) for o in outs)
    assert engine.scheduler.num_free_slots == 160


def test_a_full_trees_accepted_nodes_are_what_each_smaller_tree_accepts():
    """The full tree's nodes are ranked best first, so its accepted nodes below n are what the tree of
    its n best nodes accepts (what the adaptive policy learns each smaller size's acceptance from):
    on each prompt's first decode step (the same context for every engine), the shipped EAGLE-3 head's
    8-node tree against trees capped at 3 and 5 nodes."""
    prompts = CONVERSATIONS + [[{"role": "user", "content": q}] for q in (
        "Name the planets of the solar system.", "What is 12 times 12?", "Translate 'good morning' into French.",
        "Write one sentence about the sea.")]
    draft = dict(speculative_algorithm="EAGLE3", draft_model="smollm2-135m-instruct-eagle3", eagle_topk=4,
                 num_draft_tokens=8, adaptive_speculation=False)

    def first_steps(engine) -> list[tuple[int, list[int]]]:
        """Per prompt, its first decode step's (accepted drafts, accepted tree nodes)."""
        sched, seen = engine.scheduler, []
        observe = sched._observe_decode
        sched._observe_decode = lambda plan, ext, s: seen.append(ext) or observe(plan, ext, s)
        out = []
        for conversation in prompts:
            seen.clear()
            sched.add_request(engine.encode_chat(conversation), SamplingParams(max_tokens=4, temperature=0.0))
            while not seen:
                sched.step()
            while sched.has_unfinished():
                sched.step()
            ext = seen[0]
            out.append((int(ext.accept_lens[0]), [n for n in ext.accepted_nodes[0].tolist() if n >= 0]))
        return out

    full = first_steps(_engine(**draft))
    assert all(len(nodes) == accepted and nodes == sorted(set(nodes)) and min(nodes, default=1) >= 1
               for accepted, nodes in full)
    assert sum(accepted for accepted, _ in full) >= len(prompts)  # the shipped head is accepted
    for cap in (3, 5):
        small = first_steps(_engine(verify_budget=cap, **draft))
        assert [accepted for accepted, _ in small] == [sum(n < cap for n in nodes) for _, nodes in full]
    assert any(sum(n < 3 for n in nodes) < accepted for accepted, nodes in full)  # a 3-node tree keeps less
