"""What a step costs each engine config at one load, the configs taking single steps in turn in one process.

    python -m bench.ab_steps --configs none,serve+fixed/16 --level 64 [--steps 60] [--prompts short]
        [--dtype float32] [--max-tokens 400] [--plot] [--out bench/results/ab_steps.json]

`bench.concurrency` asks how many tokens a second each config delivers; its engines live in processes of
their own and take turns in slices of a second, and a few percent between two of them is the host as
much as the engines (this box's memory bandwidth moved `none`'s batch-1 step from 68 to 97 ms between
one-minute processes, docs/benchmarks.md session 41). This asks the narrower question that a ratio a
few percent off leaves open: does a step of one kind (a plain decode step of `level` requests, say) cost
a config more than the reference (the first config)? Each config is built twice, in mirrored order (A B
B A: engines built earlier in a process step 1-4% slower, sessions 19 and 24); each engine keeps `level`
requests in flight (`ClosedLoop`); then the engines take one step each in turn, in that same order, which
reads alike both ways, so the host's drift over a round, as over the seconds of a run, lands on every
config alike. Per config and step kind (`StepProfile`: "decode/1" is a plain decode step), over both of its
engines: the steps, their median and mean ms, the mean requests a step and committed tokens a request, and
the median's ratio to the reference's, which compares like with like only where those two match. Long
`--max-tokens` keep the load steady (few prompts joining, so few mixed steps).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
from pathlib import Path
from typing import Callable

import torch

from bench.concurrency import PROMPT_SETS, ClosedLoop, StepProfile, level_kv_slots, prompt_set, warm_up, whole_level
from bench.concurrency import parse_args as concurrency_args
from bench.configs import parse_config
from graphs.build import build_local

DEFAULT_OUT = Path(__file__).parent / "results" / "ab_steps.json"


def measure(configs: dict, conversations: list[list[dict]], level: int, steps: int, max_tokens: int,
            build: Callable = build_local) -> dict:
    """{config: {step kind: StepProfile's row (steps, median_ms, requests_per_step, context_per_request, ...) and
    its median's `ratio` to the reference's}} over `steps` rounds of one step per engine; `configs`: {name:
    EngineConfig}, the first the reference; `build(config)` makes a local engine. A step's cost grows with its
    requests and their context, so a ratio compares like with like only where those match (engines that
    decode at different speeds reach different contexts in the same rounds)."""
    names = list(configs)
    loops = []
    for name in names + names[::-1]:  # mirrored build order: every config at the same mean position
        engine = build(configs[name])
        warm_up(conversations[0], engine)
        loops.append((name, ClosedLoop(engine, conversations, level, max_tokens)))
    for _, loop in loops:
        loop.ramp_up()  # untimed: every engine holds its level before the first timed step
    for _ in range(steps):
        for _, loop in loops:  # A B B A: each config as early in the round as late
            loop.step()
    out = {name: StepProfile.combined(loop.profile for n, loop in loops if n == name).summary() for name in names}
    reference = out[names[0]]
    for kinds in out.values():
        for kind, row in kinds.items():
            row["ratio"] = round(row["median_ms"] / reference[kind]["median_ms"], 4) if kind in reference else None
    return out


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["results"])
    kinds = sorted({k for rows in result["results"].values() for k in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(kinds) * len(names)), 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rows = result["results"][name]
        ax.bar([k + i * width for k in range(len(kinds))], [rows.get(kind, {}).get("median_ms", 0) for kind in kinds],
               width, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))], kinds)
    ax.set_ylabel("median step, ms")
    meta = result["meta"]
    ax.set_title(f"{meta['level']} requests, {meta['prompts']} prompts, {meta['dtype']}, steps in turn")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ab_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="none,serve+fixed/16", help="bench.configs names, the first the reference")
    p.add_argument("--level", type=int, default=64, help="requests each engine keeps in flight")
    p.add_argument("--steps", type=int, default=60, help="rounds of one step per engine")
    p.add_argument("--prompts", default="short", choices=PROMPT_SETS)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--plot", action="store_true")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    args.configs = list(dict.fromkeys(n.strip() for n in args.configs.split(",") if n.strip()))
    if len(args.configs) < 2:
        p.error("--configs: at least two, the first the reference")
    if min(args.level, args.steps, args.max_tokens) < 1:
        p.error("--level, --steps and --max-tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # Engine options (model, drafts, KV slots for the level) as bench.concurrency builds them.
    engine_args = concurrency_args(["--dtypes", args.dtype, "--levels", str(args.level)])
    engine_args.dtype = engine_args.dtypes[0]
    conversations = prompt_set(args.prompts, 4 * args.level, engine_args.questions)
    if engine_args.kv_slots is None:  # every request of the level at once, in each engine's own pool
        engine_args.kv_slots = level_kv_slots(engine_args.model, conversations, args.level, args.max_tokens)
    configs = {name: whole_level(parse_config(name, engine_args)[1], args.level) for name in args.configs}
    with torch.inference_mode():
        results = measure(configs, conversations, args.level, args.steps, args.max_tokens)
    result = {"meta": {"level": args.level, "steps": args.steps, "prompts": args.prompts, "dtype": args.dtype,
                       "max_tokens": args.max_tokens, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                       "command": "python -m bench.ab_steps " + shlex.join(sys.argv[1:] if argv is None else argv)},
              "results": results}
    for name, kinds in results.items():
        for kind, row in kinds.items():
            print(f"[ab_steps] {name:24s} {kind:10s} {row['steps']:4d} steps  median {row['median_ms']:8.2f} ms  "
                  f"mean {row['mean_ms']:8.2f} ms  {row['requests_per_step']:5.1f} requests of {row['context_per_request']:7.1f} "
                  f"tokens  x{row['ratio'] if row['ratio'] is not None else float('nan'):.3f}",
                  file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
