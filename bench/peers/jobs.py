"""What a worker is asked to measure and what it answers, shared by both engines' workers
(standard library only: `vllm_worker` runs in the peer's venv)."""

from __future__ import annotations

import json
import sys
import time
from typing import Callable

# What each engine runs under each config name (ours: `bench.peers.ours_worker`, vLLM:
# `bench.peers.vllm_worker`). "serve" is `make serve`'s engine: its speculation (serve.settings)
# on the Ray backend; the others run our local (in-process) engine. Ours compile their target's small
# passes and attend through our C++ kernel as the run asks (`--torch-compile`, on by default as in
# `make serve`); "none-eager" is plain decoding without either, whatever the run asks.
CONFIGS = {
    "ours": ("none", "ngram", "eagle3", "serve", "none-eager"),
    "vllm": ("none", "ngram", "eagle3"),
}
NGRAM_TOKENS = 4  # prompt-lookup draft length, both engines
EAGLE3_STEPS = 3  # EAGLE-3 chain length, both engines
WARMUP_TOKENS = 4


def read_job(argv: list[str] | None = None) -> tuple[dict, str]:
    """argv: JOB.json OUT.json -> (the job, where the result goes)."""
    job_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    with open(job_path) as f:
        return json.load(f), out_path


def waves(level: int, per_level: int) -> int:
    """How many waves of `level` prompts at once a level runs: enough for `per_level` prompts."""
    return -(-max(level, per_level) // level)


def run_levels(job: dict, generate: Callable[[list[list[int]], int], list[list[int]]]) -> dict:
    """For each level L: waves of L prompts submitted at once, one wave after another, over the
    first max(L, job["prompts_per_level"]) prompts (so batch 1 averages several prompts, not the
    first one's acceptance), greedy, `max_tokens` each with EOS ignored. `generate(prompts,
    max_tokens)` returns each prompt's output ids. Every level is warmed up first with a few
    tokens (an engine that compiles per batch shape does so there)."""
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    for level in job["levels"]:
        generate(prompts[:level], WARMUP_TOKENS)
    levels = {}
    for level in job["levels"]:
        count = waves(level, job["prompts_per_level"])
        outs, wall = [], 0.0
        for wave in range(count):
            start = time.perf_counter()
            outs += generate(prompts[wave * level:(wave + 1) * level], max_tokens)
            wall += time.perf_counter() - start
        tokens = sum(len(o) for o in outs)
        levels[str(level)] = {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
                              "waves": count, "token_ids": outs}
        print(f"[bench.peers] {job['engine']}:{job['config']} {job['dtype']} {level:3d} at once x {count}: "
              f"{tokens / wall:8.2f} tok/s", file=sys.stderr, flush=True)
    return levels


def write_result(out_path: str, result: dict) -> None:
    with open(out_path, "w") as f:
        json.dump(result, f)
