"""Why a Ray runner actor does all its torch work on one thread (actors.compute_thread).

    python -m bench.omp_teams [--threads 2] [--matmuls 3000]

A loop of decode-sized matmuls (4 x 576 by 576 x 1536, each a parallel region) runs in a second
thread, as a Ray compiled graph calls an actor, in a fresh process per case:
- "one team": only that thread ever ran torch work;
- "two teams": the main thread ran some first, as an actor that builds its runner in
  `__init__` does, so libgomp manages more threads than the process has CPUs and its workers
  sleep at the end of every region instead of spinning (a futex wake-up per region);
- "compute thread": both threads hand their work to one `ComputeThread`.
Prints wall ms, CPU ms and the cores the loop kept busy; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("one team", "two teams", "compute thread")

# One case, in its own process (OpenMP teams live as long as the process).
CASE = """
import json, sys, threading, time, torch
from actors.compute_thread import ComputeThread
case, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
weights = [torch.randn(576, 1536) for _ in range(30)]
x = torch.randn(4, 576)
def loop(count):
    torch.set_num_threads(threads)
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(count):
        x @ weights[i % 30]
    return time.perf_counter() - start, time.process_time() - cpu
compute = ComputeThread() if case == "compute thread" else None
run = compute.run if compute else (lambda fn, *a: fn(*a))
if case != "one team":
    run(loop, 200)  # the main thread's start-up work
out = []
t = threading.Thread(target=lambda: out.append(run(loop, n)))
t.start(); t.join()
wall, cpu = out[0]
print(json.dumps({"wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu, "cores": cpu / wall}))
"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 2))
    parser.add_argument("--matmuls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2, help="runs per case, interleaved")
    parser.add_argument("--out", default="bench/results/omp_teams.json")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    for _ in range(args.repeats):
        for case in CASES:
            out = subprocess.run([sys.executable, "-c", CASE, case, str(args.threads), str(args.matmuls)],
                                 env=env, capture_output=True, text=True, check=True)
            runs[case].append(json.loads(out.stdout))
            r = runs[case][-1]
            print(f"{case:15s} wall {r['wall_ms']:7.1f} ms  CPU {r['cpu_ms']:7.1f} ms  cores {r['cores']:.2f}", flush=True)
    result = {"meta": {"threads": args.threads, "matmuls": args.matmuls, "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d %H:%M")}, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
