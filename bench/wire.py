"""What one step's batches cost to cross a Ray hop: Ray's pickler with torch's tensor reducer
against actors.wire's packed buffer, on the real batches of a step of the local engine.

    python -m bench.wire [--configs none,ngram,eagle3-tree] [--batches 1,16]

Per config and batch: the step input (BatchMeta, DraftInput) the scheduler sends and the output
(DraftExtendInput without hidden states, DraftInput) the colocated actor returns, each dumped
and loaded the way Ray's channels do (ray.cloudpickle, protocol 5). Times are the minimum of
`--repeats` (robust to a busy machine); a colocated step does each direction once.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

import ray
from ray import cloudpickle

from actors import wire
from bench.graph import CONFIGS, conversations, speculation
from graphs import EngineConfig, SamplingParams, build_graph
from serve.settings import DEFAULT_EAGLE3_DRAFT


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def last_step(engine, batch: int) -> tuple:
    """((meta, draft_input), (ext without hidden states, draft_input)) of the engine's last step."""
    executor = engine.scheduler.executor
    seen = []
    run = executor.execute

    def recording(meta, draft_input):
        out = run(meta, draft_input)
        seen.append(((meta, draft_input), out))
        return out

    executor.execute = recording
    try:
        engine.chat(conversations(batch), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        executor.execute = run
    step_input, (ext, draft_input) = seen[-1]
    return step_input, (ext.for_scheduler(), draft_input)


def cost(obj, repeats: int) -> dict:
    data = cloudpickle.dumps(obj, protocol=5)
    return {"dump_ms": best_ms(lambda: cloudpickle.dumps(obj, protocol=5), repeats),
            "load_ms": best_ms(lambda: pickle.loads(data), repeats), "bytes": len(data)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", default="bench/results/wire.json")
    args = parser.parse_args(argv)
    result = {"meta": {"model": args.model, "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M")}}
    for name in args.configs.split(","):
        engine = build_graph(EngineConfig(model=args.model, kv_slots=8192, **speculation(name, DEFAULT_EAGLE3_DRAFT)))
        try:
            for batch in (int(b) for b in args.batches.split(",")):
                step = dict(zip(("input", "output"), last_step(engine, batch)))
                row = {}
                for way in ("ray", "packed"):
                    if way == "packed":
                        wire.register()
                    row[way] = {k: cost(obj, args.repeats) for k, obj in step.items()}
                    for cls in wire.WIRE_TYPES:
                        ray.util.deregister_serializer(cls)
                total = {way: sum(c["dump_ms"] + c["load_ms"] for c in row[way].values()) for way in row}
                result[f"{name}/b{batch}"] = {**row, "per_step_ms": total}
                print(f"{name:12s} b={batch:2d} dump+load per step: ray {total['ray']:.3f} ms, packed "
                      f"{total['packed']:.3f} ms; " + "; ".join(
                          f"{k} {row['ray'][k]['bytes']} -> {row['packed'][k]['bytes']} B" for k in step), flush=True)
        finally:
            engine.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
