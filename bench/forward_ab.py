"""Same-run A/B of a forward-pass lever: plain decode steps of one runner with the lever on and
off, taking turns step by step, so load from other processes hits both alike.

    python -m bench.forward_ab [--dtypes bfloat16,float32] [--batches 1,16,32] [--prompt-len 128]
        [--steps 12] [--out bench/results/forward_ab.json]

Levers: `grouped_attention` (bf16/fp16 decode and verify attention as grouped matmuls on CPU,
models/attention.py; off = SDPA for every masked call). Prints JSON with the median step time of
each side and their ratio (off / on: above 1 means the lever pays).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

import models.attention as attention
from actors.slots import SlotAllocator
from actors.target_runner import TargetRunner
from bench.runner import NUM_SLOTS, _Requests
from models.registry import DEFAULT_MODEL

LEVERS = {"grouped_attention": (attention, "GROUPED_MAX_QUERIES", 0)}  # module, knob, value when off


def ab(runner: TargetRunner, batch: int, prompt_len: int, steps: int, lever: str) -> dict:
    module, knob, off_value = LEVERS[lever]
    on_value = getattr(module, knob)
    alloc = SlotAllocator(NUM_SLOTS)
    reqs = _Requests(runner, alloc, batch, prompt_len)
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for i in range(steps + 2):
            for side, value in (("on", on_value), ("off", off_value)):
                setattr(module, knob, value)
                elapsed = reqs.decode_step()
                if i >= 2:
                    times[side].append(elapsed)
    finally:
        setattr(module, knob, on_value)
    reqs.release()
    med = {side: statistics.median(t) for side, t in times.items()}
    return {"step_ms_on": round(1e3 * med["on"], 2), "step_ms_off": round(1e3 * med["off"], 2),
            "speedup": round(med["off"] / med["on"], 3)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--lever", default="grouped_attention", choices=sorted(LEVERS))
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batches", default="1,16,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="measured steps per side (after 2 warm-up steps)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("bench/results/forward_ab.json"))
    args = p.parse_args(argv)
    result: dict = {"meta": {"lever": args.lever, "model": args.model, "prompt_len": args.prompt_len,
                             "steps": args.steps, "load_avg_1m_start": round(os.getloadavg()[0], 2),
                             "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                             "command": "python -m bench.forward_ab " + shlex.join(sys.argv[1:] if argv is None else argv)},
                    "results": {}}
    for dtype in (d.strip() for d in args.dtypes.split(",") if d.strip()):
        runner = TargetRunner(args.model, num_slots=NUM_SLOTS, dtype=dtype, device="cpu", num_threads=args.threads)
        for batch in (int(b) for b in args.batches.split(",") if b):
            entry = ab(runner, batch, args.prompt_len, args.steps, args.lever)
            result["results"].setdefault(dtype, {})[str(batch)] = entry
            print(f"[bench.forward_ab] {args.lever} {dtype} batch {batch}: {entry}", file=sys.stderr, flush=True)
    result["meta"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
