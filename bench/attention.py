"""CPU attention: SDPA against `grouped_attention`, where `models.attention.grouped_pays` picks the
second (and, in `kernel` mode, against SDPA over operands upcast to fp32, where `widened_pays` picks
that). Two measurements, each on this machine's threads:

    python -m bench.attention [--mode kernel,forward] [--dtypes bfloat16,float32] [--batches 1,2,4,8,16,32,64]
        [--queries 1,2,4,8] [--keys 128,512,1024] [--model NAME] [--out FILE] [--plot]
    python -m bench.attention --mode paged ...

`paged`: one layer's whole `paged_attention` call over the KV pool (the new tokens' K/V written, then
attention over each request's slots: decode rows or a tree of Q nodes after K committed keys), PyTorch's
path (its rules choosing SDPA, grouped or widened) against our C++ kernel (`models.cpu_kernels`), the
best of three rounds of `--reps` calls each. `kernel`: one attention call over a (B, Hkv, K, D) gather (the pool's, contiguous) with a causal
mask that ends in each request's own queries, both ways, per (dtype, requests, queries, keys): the
best of three rounds of `--reps` calls. `forward`: the target model's whole forward over decode
(one query) and verify (a tree of Q nodes) rows of B requests with K committed keys each, every
attention call grouped against every one SDPA, in alternating rounds (the host's speed drifts; the
median). Each cell records both times, their ratio (grouped over SDPA) and whether the rule chooses grouped there,
so a machine where the constants are wrong shows it: grouped slower where `rule` is true, or faster
where it is false. The default model's head counts (SmolLM2: 9 query, 3 KV heads, 64 wide).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import models.attention as attention
from models.registry import DEFAULT_MODEL

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention.json"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _best_us(fn, reps: int, rounds: int = 3) -> float:
    """Fastest of `rounds` timings of `reps` calls, microseconds per call (after two warm-up calls)."""
    fn(), fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps * 1e6)
    return best


def kernel_cell(dtype: torch.dtype, batch: int, queries: int, keys: int, heads: int, kv_heads: int, dim: int,
                reps: int) -> dict:
    """One attention call both ways: q (B, Hq, Q, D) as the pass's (B, Q, Hq, D) rows transposed,
    keys (B, Hkv, K, D), the last Q keys the requests' own (causal among them)."""
    g = torch.Generator().manual_seed(batch * 1000 + queries * 10 + keys)
    q = torch.randn(batch, queries, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(batch, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
    scale = dim ** -0.5
    sdpa = _best_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True), reps)
    grouped = _best_us(lambda: attention.grouped_attention(q, k, v, mask, scale), reps)
    widened = _best_us(lambda: attention.widened_attention(q, k, v, mask, scale), reps)
    sdpa, grouped, widened = round(sdpa, 1), round(grouped, 1), round(widened, 1)  # the ratios of the figures recorded
    return {"dtype": _name(dtype), "batch": batch, "queries": queries, "keys": keys,
            "sdpa_us": sdpa, "grouped_us": grouped, "ratio": round(grouped / sdpa, 3),
            "rule": attention.grouped_pays(dtype, batch, queries, keys),
            "widened_us": widened, "widened_ratio": round(widened / sdpa, 3),
            "widened_rule": attention.widened_pays(dtype, batch, queries, keys)}


def paged_cell(dtype: torch.dtype, batch: int, queries: int, keys: int, heads: int, kv_heads: int, dim: int,
               reps: int) -> dict:
    """One layer's paged_attention call both ways: PyTorch's path and our C++ kernel, over a pool holding
    `_rows`' slots (each request's keys consecutive, as the allocator hands them out)."""
    from models import cpu_kernels

    if not cpu_kernels.load_attention_kernel():
        raise RuntimeError("bench.attention --mode paged: the C++ kernel could not be built (see the warning)")
    g = torch.Generator().manual_seed(batch * 1000 + queries * 10 + keys)
    meta = _rows(batch, queries, keys).metadata("cpu")
    rows, slots = batch * queries, batch * (keys + queries)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(kv_heads, slots, dim, generator=g).to(dtype) for _ in range(2))
    scale = dim ** -0.5
    with torch.inference_mode():
        pytorch, cpp = (round(_best_us(lambda: attention.paged_attention(q, k, v, k_cache, v_cache, meta, scale, kernel),
                                       reps), 1) for kernel in (False, True))
    return {"dtype": _name(dtype), "batch": batch, "queries": queries, "keys": keys,
            "pytorch_us": pytorch, "cpp_us": cpp, "ratio": round(cpp / pytorch, 3)}


def _rows(batch: int, queries: int, keys: int, vocab: int = 1000):
    """PassRows of `batch` requests, each `keys` committed slots then a `queries`-node tree (a root and
    its children; one node: a decode row), in consecutive slots; token ids below `vocab`."""
    from actors.pass_rows import PassRows

    width = keys + queries
    slots = torch.arange(batch * width).view(batch, width)
    tree = torch.eye(queries, dtype=torch.bool)
    tree[:, 0] = True
    depth = torch.arange(queries).clamp(max=1)
    return PassRows(tokens=torch.randint(0, vocab, (batch * queries,)), positions=(keys + depth).repeat(batch),
                    prefix=slots[:, :keys], prefix_lens=torch.full((batch,), keys), slots=slots[:, keys:].reshape(-1),
                    new_lens=torch.full((batch,), queries), trees=tree.expand(batch, queries, queries).clone())


def forward_cells(model: str, dtype: torch.dtype, shapes: list[tuple[int, int, int]], rounds: int) -> list[dict]:
    """The target's forward per (batch, queries, keys) shape, every attention call grouped and every one
    SDPA, in alternating order."""
    from actors.target_runner import TargetRunner

    slots = max(b * (k + q) for b, q, k in shapes)
    runner = TargetRunner(model, None, num_slots=slots, dtype=dtype)
    for k, v in zip(runner.kv.k, runner.kv.v):
        k.normal_(), v.normal_()
    rows = {shape: _rows(*shape, vocab=runner.model.shape.vocab_size) for shape in shapes}
    rule, widened_rule = attention.grouped_pays, attention.widened_pays

    def forward(shape, grouped: bool) -> float:
        attention.grouped_pays = lambda *_: grouped  # masked_attention looks them up
        attention.widened_pays = lambda *_: False  # grouped against SDPA in the model's dtype
        with torch.inference_mode():
            start = time.perf_counter()
            runner._run(rows[shape])
        return time.perf_counter() - start

    times: dict[tuple, list[float]] = {}
    try:
        for shape in shapes:  # warm: oneDNN primitives for each shape and path
            forward(shape, True), forward(shape, False)
        for turn in range(rounds):
            for shape in shapes:
                for grouped in ((True, False) if turn % 2 == 0 else (False, True)):
                    times.setdefault((shape, grouped), []).append(forward(shape, grouped))
    finally:
        attention.grouped_pays, attention.widened_pays = rule, widened_rule
    cells = []
    for batch, queries, keys in shapes:
        grouped, sdpa = (round(1e3 * statistics.median(times[((batch, queries, keys), flag)]), 2)
                         for flag in (True, False))
        cells.append({"dtype": _name(dtype), "batch": batch, "queries": queries, "keys": keys,
                      "sdpa_ms": sdpa, "grouped_ms": grouped, "ratio": round(grouped / sdpa, 3),
                      "rule": attention.grouped_pays(dtype, batch, queries, keys)})
    return cells


def plot(result: dict, path: Path, section: str = "kernel") -> Path:
    """Each dtype's time ratio per request count: grouped / SDPA (`kernel`) or C++ / PyTorch (`paged`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result[section]
    dtypes = sorted({c["dtype"] for c in cells})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for queries in sorted({c["queries"] for c in cells}):
            for keys in sorted({c["keys"] for c in cells}):
                pts = [(c["batch"], c["ratio"]) for c in cells
                       if c["dtype"] == dtype and c["queries"] == queries and c["keys"] == keys]
                ax.plot(*zip(*pts), marker="o", label=f"Q={queries} K={keys}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests")
        ax.set_ylabel("grouped / SDPA time" if section == "kernel" else "C++ kernel / PyTorch path time")
        ax.set_title(f"{dtype}, {result['meta']['threads']} threads")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="kernel,forward", help="kernel, forward, paged, comma-separated")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--queries", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--keys", type=_ints, default=[128, 512, 1024])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=50, help="kernel, paged: calls per timing round")
    p.add_argument("--rounds", type=int, default=6, help="forward: alternating rounds per shape")
    p.add_argument("--model", default=DEFAULT_MODEL, help="forward: the target model")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--plot", action="store_true")
    args = p.parse_args(argv)
    args.mode = {m.strip() for m in args.mode.split(",") if m.strip()}
    if not args.mode or args.mode - {"kernel", "forward", "paged"}:
        p.error(f"--mode: {sorted(args.mode)} is not a subset of kernel, forward, paged")
    args.dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    if any(not isinstance(d, torch.dtype) for d in args.dtypes):
        p.error("--dtypes: torch dtype names, e.g. bfloat16,float32")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {"meta": {"threads": torch.get_num_threads(), "torch": torch.__version__,
                             "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                             "grouped_shapes": {_name(k): list(v)
                                                for k, v in attention.GROUPED_SHAPES.items()},
                             "bf16_sdpa_without_amx": attention.bf16_sdpa_without_amx(),
                             "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                             "command": "python -m bench.attention " + shlex.join(sys.argv[1:] if argv is None else argv)}}
    if "kernel" in args.mode:
        result["kernel"] = [kernel_cell(dtype, b, q, k, args.heads, args.kv_heads, args.head_dim, args.reps)
                            for dtype in args.dtypes for b in args.batches for q in args.queries for k in args.keys]
        for c in result["kernel"]:
            print(f"[attention] kernel {c['dtype']:8s} B{c['batch']:3d} Q{c['queries']:2d} K{c['keys']:5d}  "
                  f"sdpa {c['sdpa_us']:8.1f} us  grouped {c['grouped_us']:8.1f}  x{c['ratio']:.2f}"
                  f"  widened {c['widened_us']:8.1f}  x{c['widened_ratio']:.2f}"
                  f"{'  (rule: grouped)' if c['rule'] else ''}{'  (rule: widened)' if c['widened_rule'] else ''}",
                  file=sys.stderr)
    if "paged" in args.mode:
        result["paged"] = [paged_cell(dtype, b, q, k, args.heads, args.kv_heads, args.head_dim, args.reps)
                           for dtype in args.dtypes for b in args.batches for q in args.queries for k in args.keys]
        for c in result["paged"]:
            print(f"[attention] paged {c['dtype']:8s} B{c['batch']:3d} Q{c['queries']:2d} K{c['keys']:5d}  "
                  f"pytorch {c['pytorch_us']:8.1f} us  C++ {c['cpp_us']:8.1f}  x{c['ratio']:.2f}", file=sys.stderr)
    if "forward" in args.mode:
        shapes = [(b, q, k) for b in args.batches for q in args.queries for k in args.keys]
        result["forward"] = [c for dtype in args.dtypes for c in forward_cells(args.model, dtype, shapes, args.rounds)]
        for c in result["forward"]:
            print(f"[attention] forward {c['dtype']:8s} B{c['batch']:3d} Q{c['queries']:2d} K{c['keys']:5d}  "
                  f"sdpa {c['sdpa_ms']:7.2f} ms  grouped {c['grouped_ms']:7.2f}  x{c['ratio']:.3f}"
                  f"{'  (rule: grouped)' if c['rule'] else ''}", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for section in ("kernel", "paged"):
        if args.plot and section in result:
            plot(result, out.with_name(f"{out.stem}_{section}.png") if "kernel" in result and "paged" in result
                 else out.with_suffix(".png"), section)
    return result


if __name__ == "__main__":
    main()
