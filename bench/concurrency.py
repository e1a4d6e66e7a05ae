"""Throughput against batch size: where speculation stops paying, and what the batch limits
(`disable_by_batch_size`, `verify_budget`) give back.

    python -m bench.concurrency [--levels 1,2,4,8,16,32] [--max-tokens 64]
        [--configs none,ngram,eagle3,eagle3-tree-ngram,eagle3-tree-ngram@4,eagle3-tree-ngram/32] [--plot]

Each level submits that many held-out self-written prompts at once (`train.data.EVAL_SEED`,
never Spec-Bench, so a cutoff picked from this run is not tuned on the evaluation set), greedy,
`ignore_eos` so the batch stays full for all `--max-tokens` steps. Configs are those of
`bench.configs`; `NAME/B@N` is NAME with `verify_budget=B` and `disable_by_batch_size=N`
(either part optional). Every config is loaded first and they take turns at each level, so load
from other processes hits them alike. Output tokens must equal `none`'s (greedy speculation is
lossless); differing requests are counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.configs import REFERENCE, add_engine_args, kv_slots_for, parse_config
from graphs import SamplingParams, build_graph
from graphs.engine import Engine
from models.build import ModelSource, load_tokenizer
from train.data import EVAL_SEED, build_prompt_set

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "concurrency.json"


def run_level(engine, conversations: list[list[dict]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.chat(conversations, params)
    wall = time.perf_counter() - start
    for out in outs:
        if out.error:
            raise RuntimeError(f"request failed: {out.error}")
    return {"wall_s": wall, "tokens": sum(o.num_output_tokens for o in outs),
            "steps": sum(o.num_verify_steps for o in outs), "token_ids": [list(o.token_ids) for o in outs]}


def measure(configs: dict, levels: list[int], conversations: list[list[dict]], max_tokens: int,
            repeats: int) -> dict:
    """{config: {level: {tokens_per_s, wall_s, acceptance_length, speedup, mismatches}}}; each level
    runs `repeats` rounds of every config in turn, and tokens/s is total tokens over total wall time."""
    engines = {}
    try:
        for name, cfg in configs.items():
            engines[name] = build_graph(cfg)
            engines[name].chat(conversations[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm up
        results: dict[str, dict] = {name: {} for name in configs}
        for level in levels:
            runs = {name: [] for name in engines}
            for _ in range(repeats):
                for name, engine in engines.items():
                    runs[name].append(run_level(engine, conversations[:level], max_tokens))
            wall = {name: sum(r["wall_s"] for r in rs) for name, rs in runs.items()}
            tps = {name: sum(r["tokens"] for r in rs) / wall[name] for name, rs in runs.items()}
            reference = runs[REFERENCE][0]["token_ids"]
            for name, rs in runs.items():
                entry = {"tokens_per_s": tps[name], "wall_s": wall[name], "speedup": tps[name] / tps[REFERENCE],
                         "acceptance_length": sum(r["tokens"] for r in rs) / max(1, sum(r["steps"] for r in rs)),
                         "mismatches": sum(a != b for r in rs for a, b in zip(r["token_ids"], reference))}
                results[name][str(level)] = {k: round(v, 3) for k, v in entry.items()}
                print(f"[concurrency] {level:3d} requests {name:24s} {entry['tokens_per_s']:8.2f} tok/s  "
                      f"x{entry['speedup']:.2f}  accept {entry['acceptance_length']:.2f}", file=sys.stderr)
        return results
    finally:
        for engine in engines.values():
            engine.shutdown()


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["meta"]["levels"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, per_level in result["results"].items():
        style = "--" if "@" in name or "/" in name else "-"
        for ax, key in zip(axes, ("tokens_per_s", "speedup")):
            ax.plot(levels, [per_level[str(n)][key] for n in levels], style, marker="o", label=name)
    for ax, label in zip(axes, ("output tokens/s", f"speedup over '{REFERENCE}'")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    meta = result["meta"]
    fig.suptitle(f"{meta['model']}, {meta['backend']} backend, {meta['dtype']}, {meta['threads']} threads, "
                 f"{meta['max_tokens']} tokens per request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="none,ngram,eagle3,eagle3-tree-ngram")
    add_engine_args(p, draft_eagle3="smollm2-135m-instruct-eagle3", draft_standalone="smollm2-135m-instruct-standalone",
                    standalone_steps=3, dtype="auto")
    p.add_argument("--levels", default="1,2,4,8,16,32", help="concurrent requests, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="rounds of every config per level")
    p.add_argument("--backend", default="local", choices=("local", "ray"),
                   help="ray: actors as `make serve` runs them (one CPU, so one thread, per actor)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--plot", action="store_true")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    if min(args.levels) < 1 or args.max_tokens < 1 or args.repeats < 1:
        p.error("--levels, --max-tokens and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(dict.fromkeys([REFERENCE] + [n.strip() for n in args.configs.split(",") if n.strip()]))
    prompts = build_prompt_set(max(args.levels), EVAL_SEED)
    conversations = [p["messages"] for p in prompts[: max(args.levels)]]
    if args.kv_slots is None:  # every request of the largest level at once
        encoder = SimpleNamespace(tokenizer=load_tokenizer(ModelSource.resolve(args.model).folder))
        ids = [Engine.encode_chat(encoder, c) for c in conversations]
        args.kv_slots = kv_slots_for(ids, max(args.levels), args.max_tokens)
    configs = {name: dataclasses.replace(cfg, backend=args.backend)
               for name, cfg in (parse_config(name, args) for name in names)}
    if args.backend == "ray":
        import ray

        from graphs.runtime import graph_bundles

        # Logical CPUs for every config's actors at once (they share the machine's cores).
        needed = sum(b.get("CPU", 0) for cfg in configs.values() for b in graph_bundles(cfg))
        ray.init(address="local", num_cpus=math.ceil(needed) + 1, include_dashboard=False, log_to_driver=False)
        try:
            results = measure(configs, args.levels, conversations, args.max_tokens, args.repeats)
        finally:
            ray.shutdown()
    else:
        results = measure(configs, args.levels, conversations, args.max_tokens, args.repeats)
    result = {
        "meta": {"model": args.model, "backend": args.backend, "levels": args.levels, "max_tokens": args.max_tokens,
                 "repeats": args.repeats,
                 "dtype": str(next(iter(configs.values())).torch_dtype).removeprefix("torch."),
                 "threads": torch.get_num_threads(), "torch": torch.__version__, "prompts": f"train.data eval seed {EVAL_SEED}",
                 "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "command": "python -m bench.concurrency " + shlex.join(sys.argv[1:] if argv is None else argv)},
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
