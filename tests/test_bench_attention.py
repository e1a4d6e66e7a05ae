"""bench.attention: both measurements run on tiny shapes and record what the rule chooses."""

import json

import torch

from bench import attention as bench_attention
from models.attention import grouped_pays


def test_kernel_and_forward_cells_record_both_ways_and_the_rule(tmp_path, tiny_target):
    out = tmp_path / "attention.json"
    result = bench_attention.main(["--dtypes", "float32", "--batches", "2,16", "--queries", "1,2", "--keys", "8",
                                   "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--reps", "2",
                                   "--rounds", "2", "--model", str(tiny_target), "--out", str(out)])
    assert json.loads(out.read_text()) == result
    kernel, forward = result["kernel"], result["forward"]
    assert [(c["batch"], c["queries"]) for c in kernel] == [(2, 1), (2, 2), (16, 1), (16, 2)]
    assert [(c["batch"], c["queries"]) for c in forward] == [(2, 1), (2, 2), (16, 1), (16, 2)]
    for c in kernel:
        assert c["sdpa_us"] > 0 and c["grouped_us"] > 0 and c["widened_us"] > 0
        assert abs(c["ratio"] - c["grouped_us"] / c["sdpa_us"]) < 0.01
        assert abs(c["widened_ratio"] - c["widened_us"] / c["sdpa_us"]) < 0.01
        assert not c["widened_rule"]  # fp32
    for c in kernel + forward:
        assert c["rule"] == grouped_pays(torch.float32, c["batch"], c["queries"], c["keys"])
    assert [c["rule"] for c in forward] == [False, False, True, False]
    for c in forward:
        assert c["sdpa_ms"] > 0 and c["grouped_ms"] > 0
        assert abs(c["ratio"] - c["grouped_ms"] / c["sdpa_ms"]) < 0.01
    assert result["meta"]["grouped_shapes"]["float32"] == [16, 1, 1]


def test_forward_rows_are_decode_rows_or_trees_over_their_keys():
    rows = bench_attention._rows(3, 4, 5)
    assert rows.num_requests == 3 and rows.num_tokens == 12
    assert rows.positions.tolist()[:4] == [5, 6, 6, 6]  # a root, then its children one deeper
    assert rows.trees[0].tolist() == [[True, False, False, False], [True, True, False, False],
                                      [True, False, True, False], [True, False, False, True]]
    assert set(rows.slots.tolist()).isdisjoint(rows.prefix.flatten().tolist())


def test_paged_cells_time_pytorch_and_the_cpp_kernel(tmp_path):
    from models import cpu_kernels

    if not cpu_kernels.load_attention_kernel():
        import pytest

        pytest.skip("no C++ compiler for the kernel")
    out = tmp_path / "paged.json"
    result = bench_attention.main(["--mode", "paged", "--dtypes", "float32,bfloat16", "--batches", "1,4",
                                   "--queries", "1,3", "--keys", "8", "--heads", "4", "--kv-heads", "2",
                                   "--head-dim", "8", "--reps", "2", "--out", str(out), "--plot"])
    assert json.loads(out.read_text()) == result and out.with_suffix(".png").exists()
    cells = result["paged"]
    assert [(c["dtype"], c["batch"], c["queries"]) for c in cells] == [
        (d, b, q) for d in ("float32", "bfloat16") for b in (1, 4) for q in (1, 3)]
    for c in cells:
        assert c["pytorch_us"] > 0 and c["cpp_us"] > 0 and abs(c["ratio"] - c["cpp_us"] / c["pytorch_us"]) < 0.01
