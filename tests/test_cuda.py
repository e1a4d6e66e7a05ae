"""The CUDA path, on a machine with a GPU (skipped elsewhere; CI has none): the runners decode on
the GPU losslessly for every draft kind, and the EAGLE-3 trainer's `--use-gpu` path (target
features computed on the GPU, the TTT loop on the GPU, no Ray) trains a head that serves
losslessly. Everything else in the suite also runs on CUDA there, since engines pick
`device="auto"`."""

from __future__ import annotations

import pytest
import torch

from graphs import EngineConfig, SamplingParams, build_graph
from test_train import _eval_conversations, _greedy, tiny  # noqa: F401  (tiny is a fixture)
from train import runlog

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [30, 31, 30, 31, 30, 31]]


def _run(target, **kw):
    engine = build_graph(EngineConfig(model=str(target), kv_slots=2048, **kw))
    try:
        assert engine.scheduler.executor.target.kv.k[0].is_cuda
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    finally:
        engine.shutdown()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("algorithm,draft,topk,n", [
    ("NGRAM", None, 1, 4),
    ("STANDALONE", "tiny_standalone", 2, 6),
    ("EAGLE3", "tiny_eagle3_shared", 4, 8),
    ("EAGLE3", "tiny_eagle3_own", 1, 4),
])
def test_runners_on_cuda_decode_losslessly(request, tiny_target, algorithm, draft, topk, n):
    reference = _run(tiny_target)
    draft_path = request.getfixturevalue(draft) if draft else None
    spec = _run(tiny_target, speculative_algorithm=algorithm, draft_model=draft_path and str(draft_path),
                eagle_topk=topk, num_draft_tokens=n, num_steps=3)
    assert spec == reference


def test_eagle3_trainer_on_gpu(tiny):
    from train import eagle3

    out, work = tiny["root"] / "eagle3_gpu", tiny["root"] / "eagle3_gpu_work"
    eagle3.main(["--target", str(tiny["target"]), "--data", str(tiny["data"]), "--out", str(out),
                 "--work-dir", str(work), "--draft-vocab-size", "48", "--hidden", "64", "--heads", "4",
                 "--kv-heads", "2", "--intermediate", "64", "--epochs", "40", "--token-budget", "256", "--lr", "1e-2",
                 "--warmup", "5", "--max-steps", "40", "--save-every", "20", "--eval-every", "20", "--holdout", "0.1",
                 "--topk", "8", "--use-gpu", "--no-ray"])
    train = [r["loss"] for r in runlog.read_log(work / "log.jsonl") if r["kind"] == "train"]
    assert len(train) == 40 and sum(train[-5:]) / 5 < 0.95 * sum(train[:5]) / 5
    prompts = _eval_conversations(tiny)
    reference = _greedy(tiny["target"], prompts=prompts)
    spec = _greedy(tiny["target"], out, "EAGLE3", prompts=prompts, num_steps=3)
    assert [o.token_ids for o in spec] == [o.token_ids for o in reference]


@pytest.mark.parametrize("algorithm,draft", [("NONE", None), ("EAGLE3", "tiny_eagle3_shared")])
def test_cuda_graphs_on_and_off_decode_alike(request, tiny_target, algorithm, draft):
    """fp32, CUDA graphs on vs off: the same tokens (and the reference's), with the small passes
    replayed from graphs (target verify; EAGLE-3 tree: draft levels and extends too)."""
    kw = dict(speculative_algorithm=algorithm, adaptive_speculation=False, cost_probe=False)
    if draft:
        kw.update(draft_model=str(request.getfixturevalue(draft)), eagle_topk=4, num_draft_tokens=8, num_steps=3)
    off = _run(tiny_target, cuda_graphs=False, **kw)
    engine = build_graph(EngineConfig(model=str(tiny_target), kv_slots=2048, **kw))
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        target, drafter = engine.scheduler.executor.target, engine.scheduler.executor.drafter
        assert target.graphs is not None and target.graphs.replays > 0
        if draft:
            assert all(g.replays > 0 for g in drafter.graphs.values())
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outs] == off == _run(tiny_target)
