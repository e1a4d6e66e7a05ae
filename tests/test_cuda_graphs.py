"""CUDA graphs' CPU-checkable half (actors.cuda_graphs): which passes get a graph shape and
which run eagerly, and that the padded static-buffer pass a graph replays (idle requests,
padding tokens, wider key tables) leaves every real row's output unchanged. On CPU `StepGraphs`
runs that pass eagerly; tests/test_cuda.py checks the captured graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from actors.cuda_graphs import MAX_NODES, StepGraphs, batch_bucket, key_bucket, plan
from actors.pass_rows import PassRows
from actors.target_runner import TargetRunner
from graphs import EngineConfig, SamplingParams, build_graph
from spec.tree import ancestor_mask

NUM_SLOTS = 512


def _rows(prefix_lens: list[int], new_lens: list[int], trees: torch.Tensor | None = None, first_slot: int = 0,
          seed: int = 0) -> PassRows:
    """Requests with consecutive fresh slots: prefix_lens[b] committed, new_lens[b] new tokens."""
    g = torch.Generator().manual_seed(seed)
    b, width = len(new_lens), max(prefix_lens + [1])
    prefix = torch.zeros((b, width), dtype=torch.long)
    slot = first_slot
    for i, p in enumerate(prefix_lens):
        prefix[i, :p] = torch.arange(slot, slot + p)
        slot += p
    slots = torch.arange(slot, slot + sum(new_lens))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)])
    return PassRows(tokens=torch.randint(0, 64, (sum(new_lens),), generator=g), positions=positions,
                    prefix=prefix, prefix_lens=torch.tensor(prefix_lens), slots=slots,
                    new_lens=torch.tensor(new_lens), trees=trees)


def test_batch_and_key_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 16, 17, 256)] == [1, 2, 4, 8, 16, 32, 256]
    assert batch_bucket(257) is None
    assert [key_bucket(n) for n in (1, 256, 257, 1500)] == [256, 256, 512, 2048]


def test_plan_graphs_small_passes_and_leaves_the_rest_eager():
    tree = ancestor_mask(torch.tensor([[-1, 0, 0, 1]] * 3))
    verify = plan(_rows([5, 9, 300], [4, 4, 4], tree))
    assert (verify.batch, verify.nodes, verify.keys, verify.trees) == (4, 4, 512, True)
    extend = plan(_rows([5, 9, 2], [1, 3, 2]))  # a draft extend: accepted lengths differ
    assert (extend.batch, extend.nodes, extend.trees) == (4, 3, False)
    assert plan(_rows([0, 0], [7, 3])) is None  # a prefill from scratch
    assert plan(_rows([4], [MAX_NODES + 1])) is None  # a prompt chunk
    assert plan(_rows([3] * 257, [1] * 257)) is None  # above the largest bucket
    mixed = _rows([3, 4, 5], [2, 2, 20], tree[:2, :2, :2])  # verify rows, then a chunk
    assert plan(mixed) is None


@pytest.fixture(scope="module")
def runner(tiny_target):
    return TargetRunner(str(tiny_target), num_slots=NUM_SLOTS, device="cpu")


def _prefill(runner: TargetRunner, lens: list[int]) -> None:
    """Commit `lens` prompt tokens per request in slots 0 .. sum(lens) (a fresh prefill)."""
    runner._run(_rows([0] * len(lens), lens, seed=1))


@pytest.mark.parametrize("case", ["verify", "decode", "extend"])
@torch.inference_mode()
def test_padded_pass_equals_eager_for_the_real_rows(runner, case):
    """Verify trees (3 requests -> bucket 4), plain decode rows, and ragged extend rows (each
    request padded to the longest): the padded pass's real rows equal the eager pass's in fp32
    (to rounding: the padded keys change SDPA's summation blocks, ~1e-6 apart on CPU), and the
    padding wrote no real slot."""
    _prefill(runner, [5, 9, 7])
    prefix = [5, 9, 7]
    if case == "verify":
        rows = _rows(prefix, [4] * 3, ancestor_mask(torch.tensor([[-1, 0, 0, 1]] * 3)), seed=2)
    elif case == "decode":
        rows = _rows(prefix, [1] * 3, seed=3)
    else:
        rows = _rows(prefix, [1, 3, 2], seed=4)
    eager_hidden, _ = runner._run(rows)
    eager_kv = runner.kv.k[0].clone()
    graphs = StepGraphs(runner._forward, "cpu", dump_slot=NUM_SLOTS, capture=False)
    padded_hidden, _ = graphs.run(rows)
    assert graphs.replays == 1
    torch.testing.assert_close(padded_hidden, eager_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.kv.k[0][:, :NUM_SLOTS], eager_kv[:, :NUM_SLOTS], rtol=1e-5, atol=1e-5)


def _generate(target, graphs: bool, **kw):
    engine = build_graph(EngineConfig(model=str(target), kv_slots=1024, cost_probe=False,
                                      adaptive_speculation=False, **kw))
    try:
        runners = [engine.scheduler.executor.target, engine.scheduler.executor.drafter]
        if graphs:
            for r in runners:
                if hasattr(r, "use_step_graphs"):
                    r.use_step_graphs(capture=False)
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [30, 31, 30, 31, 30, 31]]
        outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        replays = [g.replays for r in runners for g in ([r.graphs] if isinstance(r, TargetRunner) else
                                                          getattr(r, "graphs", {}).values()) if g is not None]
    finally:
        engine.shutdown()
    return [(o.token_ids, o.accept_lens) for o in outs], replays


@pytest.mark.parametrize("algorithm,draft", [("NONE", None), ("EAGLE3", "tiny_eagle3_shared")])
def test_engine_through_padded_static_passes_is_lossless(request, tiny_target, algorithm, draft):
    """Whole generations with every small pass through the static buffers (target verify,
    draft levels and extends) equal the eager engine's tokens, for plain decoding and the
    EAGLE-3 tree, and accept the same drafts at every step (the draft's passes proposed alike:
    outputs alone would stay lossless whatever the draft did)."""
    kw = dict(speculative_algorithm=algorithm)
    if draft:
        kw.update(draft_model=str(request.getfixturevalue(draft)), eagle_topk=4, num_draft_tokens=8, num_steps=3)
    eager, _ = _generate(tiny_target, False, **kw)
    padded, replays = _generate(tiny_target, True, **kw)
    assert padded == eager
    assert all(n > 0 for n in replays)  # every runner's small passes went through them


def test_cuda_graphs_option_is_validated():
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    assert EngineConfig(cuda_graphs=False).runner_kwargs(1)["cuda_graphs"] is False
