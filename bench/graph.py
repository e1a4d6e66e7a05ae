"""Ray graph benchmark: per-step Ray overhead of the compiled graph vs plain actor calls,
and throughput at 1/4/16/64 concurrent requests with and without speculation, next to the
local backend, all in one run.

    python -m bench.graph [--model smollm2-135m-instruct] [--max-tokens 32] [--plot]

Ray overhead per step = wall time of executing the step (scheduler side) minus the compute
time the actors measured inside themselves, at batch 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import ray
import torch

from graphs import EngineConfig, SamplingParams, build_graph

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea.",
    "Give three tips for learning a new language.",
    "What are the main causes of inflation?",
    "Describe the water cycle in simple terms.",
    "List five fruits that are rich in vitamin C.",
    "How does a bicycle stay upright when moving?",
    "Summarize the plot of a heist movie you invent.",
]


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]


def actor_compute(engine) -> float:
    return sum(ray.get(a.stats.remote(reset=True))["compute_s"] for a in engine.actors())


def ray_overhead(base: dict, compiled: bool, max_tokens: int, repeats: int) -> dict:
    engine = build_graph(EngineConfig(**base, backend="ray", compiled_graph=compiled))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.chat(conversations(1), params)  # warm up
        actor_compute(engine)
        before = engine.stats()
        for _ in range(repeats):
            engine.chat(conversations(1), params)
        after = engine.stats()
        steps = after["executed_steps"] - before["executed_steps"]
        wall = after["execute_s"] - before["execute_s"]
        compute = actor_compute(engine)
        return {"steps": steps, "step_ms": 1e3 * wall / steps, "compute_ms": 1e3 * compute / steps,
                "overhead_ms": 1e3 * (wall - compute) / steps, "overhead_fraction": (wall - compute) / wall}
    finally:
        engine.shutdown()


def throughput(engine, concurrency: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.chat(conversations(concurrency), params)
    wall = time.perf_counter() - start
    tokens = sum(o.num_output_tokens for o in outs)
    steps = sum(o.num_verify_steps for o in outs)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "acceptance_length": tokens / steps}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft-model", default=None, help="EAGLE3 draft; NGRAM is used when absent")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--overhead-repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/graph.json")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    spec = ({"speculative_algorithm": "EAGLE3", "draft_model": args.draft_model} if args.draft_model
            else {"speculative_algorithm": "NGRAM", "num_steps": 4})
    algorithms = {"none": {}, spec["speculative_algorithm"].lower(): spec}
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    base = {"model": args.model, "kv_slots": 8192, "max_running_requests": max(levels)}
    result = {"meta": {"model": args.model, "max_tokens": args.max_tokens, "torch": torch.__version__,
                       "python": platform.python_version(), "threads": torch.get_num_threads(),
                       "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)},
              "overhead_batch1": {}, "throughput": {}}
    for name, compiled in (("compiled_graph", True), ("actor_calls", False)):
        result["overhead_batch1"][name] = ray_overhead({**base, **spec}, compiled, args.max_tokens, args.overhead_repeats)
    for backend in ("local", "ray"):
        for alg, extra in algorithms.items():
            engine = build_graph(EngineConfig(**base, **extra, backend=backend))
            try:
                engine.chat(conversations(1), SamplingParams(max_tokens=4, temperature=0.0))  # warm up
                result["throughput"][f"{backend}/{alg}"] = {str(c): throughput(engine, c, args.max_tokens) for c in levels}
            finally:
                engine.shutdown()
    ray.shutdown()
    for key, per_level in result["throughput"].items():
        per_level["scaling_16_vs_1"] = per_level.get("16", {}).get("tokens_per_s", 0) / per_level[str(levels[0])]["tokens_per_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, levels, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    return result


def plot(result: dict, levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, per_level in result["throughput"].items():
        left.plot(levels, [per_level[str(c)]["tokens_per_s"] for c in levels], marker="o", label=key)
    left.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput")
    left.legend()
    names = list(result["overhead_batch1"])
    compute = [result["overhead_batch1"][n]["compute_ms"] for n in names]
    overhead = [result["overhead_batch1"][n]["overhead_ms"] for n in names]
    right.bar(names, compute, label="actor compute")
    right.bar(names, overhead, bottom=compute, label="Ray overhead")
    right.set(ylabel="ms per step (batch 1)", title="Step time")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
