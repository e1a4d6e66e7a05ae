"""Our C++ CPU attention kernel (models.cpu_kernels): the same attention and KV writes as the PyTorch
path for every kind of pass it takes, a schema and fake the compiled graph can trust, the runners
turning it on with torch_compile, and PyTorch's path kept where it cannot be built."""

from __future__ import annotations

import pytest
import torch

from models import cpu_kernels
from models.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.load_attention_kernel(), reason="no C++ compiler for the kernel")


def _pass(new_lens: list[int], prefix_lens: list[int], trees: bool, seed: int, heads: int, kv_heads: int,
          dim: int, dtype: torch.dtype):
    """q/k/v of a pass, a pool with random contents and scattered prefix slots, and its metadata."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(256, generator=g)
    prefixes, news, cursor = [], [], 0
    for p, n in zip(prefix_lens, new_lens):
        prefixes.append(slots[cursor:cursor + p])
        news.append(slots[cursor + p:cursor + p + n])
        cursor += p + n
    masks = [((torch.rand(n, n, generator=g) < 0.5).tril() | torch.eye(n, dtype=torch.bool)) if trees else None
             for n in new_lens]
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)])
    meta = AttentionMetadata.build(prefixes, news, positions, masks)
    rows = sum(new_lens)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(kv_heads, 256, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("new_lens,prefix_lens,trees", [
    ([1], [37], False),                      # one request's decode
    ([1, 1, 1, 1, 1], [3, 40, 17, 1, 60], False),  # decode of ragged contexts
    ([6], [21], True),                       # one request's verify tree
    ([4, 4, 4], [9, 30, 2], True),           # trees of a few requests
    ([8], [150], True),                      # one request's tree over keys that end mid-tile
    ([2, 5, 3], [12, 0, 25], False),         # ragged chains: padded queries, a request without a prefix
    ([16, 3], [33, 7], False),               # the longest queries the kernel takes, a padded one
    ([20], [12], False),                     # a longer chunk after a prefix: the PyTorch path's
])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 6, 16), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_attends_as_the_pytorch_path(new_lens, prefix_lens, trees, heads, kv_heads, dim, dtype):
    q, k, v, k_cache, v_cache, meta = _pass(new_lens, prefix_lens, trees, len(new_lens) + heads, heads, kv_heads, dim,
                                            dtype)
    # The reference in fp32 (a bf16 kernel widens as it loads and rounds once, at the output).
    ref_k, ref_v = k_cache.float(), v_cache.float()  # copies, written by the reference pass
    ref = paged_attention(q.float(), k.float(), v.float(), ref_k, ref_v, meta, dim ** -0.5)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, dim ** -0.5, kernel=True)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    # The new tokens' K/V are in their slots, every other slot untouched.
    torch.testing.assert_close(k_cache.float(), ref_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.float(), ref_v, atol=0, rtol=0)
    assert torch.equal(k_cache[:, meta.out_slots].transpose(0, 1), k)


def test_kernel_operator_returns_what_its_fake_promises():
    q, k, v, k_cache, v_cache, meta = _pass([2, 3], [5, 9], False, 0, 4, 2, 16, torch.float32)
    torch.library.opcheck(torch.ops.specgraph_kernels.paged_attention.default,
                          (q, k, v, k_cache, v_cache, meta.out_slots, meta.kv_index, meta.mask, meta.q_index,
                           meta.out_rows, 0.25),
                          test_utils=("test_schema", "test_faketensor"))


def test_runners_attend_through_the_kernel_with_torch_compile(tiny_target, tiny_eagle3_own, monkeypatch):
    import actors.target_runner
    from actors.draft_runner import DraftRunner
    from actors.target_runner import TargetRunner
    from models.layers import Attention

    monkeypatch.setattr(actors.target_runner, "compiles", lambda *_: False)  # the kernel alone: no inductor build
    target = TargetRunner(str(tiny_target), num_slots=32, dtype="float32", device="cpu", torch_compile=True)
    draft = DraftRunner("eagle3", str(tiny_eagle3_own), str(tiny_target), num_steps=2, topk=2, tree_size=4,
                        num_slots=32, dtype="float32", device="cpu", torch_compile=True)
    eager = TargetRunner(str(tiny_target), num_slots=32, dtype="float32", device="cpu")
    for runner, on in ((target, True), (draft, True), (eager, False)):
        layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
        assert layers and all(m.kernel is on for m in layers) and runner.attention_kernel is on


def test_attention_stays_on_pytorch_where_the_kernel_cannot_be_built(tiny_target, monkeypatch, caplog):
    import torch.utils.cpp_extension

    import actors.target_runner
    from actors.target_runner import TargetRunner
    from models.layers import Attention

    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fail)
    assert cpu_kernels.load_attention_kernel.__wrapped__() is False  # the build itself, past the process's cache
    assert "attention stays on PyTorch's path" in caplog.text and "no C++ compiler" in caplog.text
    monkeypatch.setattr(cpu_kernels, "load_attention_kernel", lambda: False)
    monkeypatch.setattr(actors.target_runner, "compiles", lambda *_: False)
    runner = TargetRunner(str(tiny_target), num_slots=32, dtype="float32", device="cpu", torch_compile=True)
    assert runner.attention_kernel is False
    assert not any(m.kernel for m in runner.model.modules() if isinstance(m, Attention))


@pytest.mark.parametrize("new_lens,trees,dim,pytorch_path", [
    ([1, 1, 1], False, 16, False),  # decode rows: the one-query loops
    ([4, 4], True, 16, False),      # verify trees: the several-query loops
    ([16], False, 16, False),
    ([17], False, 16, True),        # longer queries: the PyTorch path's SDPA
    ([4, 4], True, 24, True),       # several queries over heads not a whole number of the kernel's tiles
    ([1, 1], False, 24, False),
])
def test_the_kernel_runs_up_to_16_queries_a_request_and_the_pytorch_path_more(new_lens, trees, dim, pytorch_path):
    """Passes of up to 16 queries a request attend in the kernel's loops; longer prompt chunks after a
    prefix go back to the PyTorch path's operator, whose SDPA shares their work better."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, k_cache, v_cache, meta = _pass(new_lens, [10] * len(new_lens), trees, 1, 4, 2, dim, torch.float32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, kernel=True)
    names = {e.name for e in prof.events()}
    assert "specgraph_kernels::paged_attention" in names
    assert ("specgraph::paged_attention" in names) is pytorch_path
