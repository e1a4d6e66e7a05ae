"""One measurement of our engine (project venv): `python -m bench.peers.ours_worker JOB OUT`."""

from __future__ import annotations

import time

from bench.peers.jobs import EAGLE3_STEPS, NGRAM_TOKENS, read_job, run_levels, write_result
from graphs import EngineConfig, SamplingParams, build_graph
from serve.settings import DEFAULT_SPECULATION, SERVE_TORCH_COMPILE


def engine_config(job: dict) -> EngineConfig:
    name = job["config"]
    common = dict(model=job["model"], dtype=job["dtype"], kv_slots=job["kv_slots"],
                  max_running_requests=max(job["levels"]),
                  torch_compile=job.get("torch_compile", SERVE_TORCH_COMPILE) and name != "none-eager")
    if name in ("none", "none-eager"):
        return EngineConfig(**common)
    if name == "ngram":
        return EngineConfig(speculative_algorithm="ngram", num_steps=NGRAM_TOKENS, **common)
    if name == "eagle3":
        return EngineConfig(speculative_algorithm="eagle3", draft_model=job["draft"], num_steps=EAGLE3_STEPS, **common)
    if name == "serve":
        # `make serve`'s engine as serve.settings builds it: its speculation on the Ray backend, so
        # the scheduler actor, the runner actors and the compiled graph's hops are in the figure.
        return EngineConfig(**dict(DEFAULT_SPECULATION, draft_model=job["draft"]), backend="ray", **common)
    raise ValueError(f"config: unknown config {name!r} for our engine")


def main() -> None:
    job, out_path = read_job()
    start = time.perf_counter()
    engine = build_graph(engine_config(job))
    load_s = time.perf_counter() - start
    try:
        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for out in outs:
                if out.error:
                    raise RuntimeError(f"request failed: {out.error}")
            return [list(o.token_ids) for o in outs]

        levels = run_levels(job, generate)
    finally:
        engine.shutdown()
    write_result(out_path, {"load_s": round(load_s, 2), "levels": levels})


if __name__ == "__main__":
    main()
