"""Where time to first token goes: multi-turn conversations through the Ray backend's offline
asyncio API (`RayEngine.astream_events`), each request's first event carrying the scheduler
actor's stamps (graphs/scheduler_actor.py `_first_event_timing`).

    python -m bench.ttft_hops [--concurrency 4] [--conversations 16] [--max-tokens 64] [--first-answer-tokens 512]
        [--configs spec,spec-noshort,spec-nocache] [--dtype auto] [--out FILE]

Configs: `spec` is what `make serve` runs; `-noshort` sets short_prefill_tokens 0 (prompts ride
in the decode step), `-nocache` turns the prefix cache off. Per config and turn, medians in ms:
submit (call -> queued in the actor), wait_step (queued -> start of the step that made the first
token: the step in flight, chunks before it), first_step (that step), publish, stream_back
(actor -> caller), and the TTFT; `steps` counts steps ended from submission to the first token.
The HTTP hops (proxy, ingress, engine replica, SSE) add ~50 ms on top on this machine at 4
clients. Wall times: on a shared machine compare shares and same-run ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

HOPS = (("submit", "called", "arrival"), ("wait_step", "arrival", "step_started"),
        ("first_step", "step_started", "step_ended"), ("publish", "step_ended", "published"),
        ("stream_back", "published", "received"))


async def _first_token(engine, messages, max_tokens: int) -> tuple[dict, str]:
    from spec.sampling import SamplingParams

    called, row, text = time.monotonic(), None, []
    async for event in engine.astream_events(messages, SamplingParams(max_tokens=max_tokens)):
        if row is None:
            row = dict(event["timing"], called=called, received=time.monotonic())
        text.append(event["delta"])
    return row, "".join(text)


async def _conversations(engine, conversations, concurrency: int, max_tokens: int,
                         first_answer_tokens: int | None = None) -> list[tuple[dict, dict]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(turns):
        async with gate:
            first, answer = await _first_token(engine, [{"role": "user", "content": turns[0]}],
                                               first_answer_tokens or max_tokens)
            second, _ = await _first_token(engine, [{"role": "user", "content": turns[0]},
                                                    {"role": "assistant", "content": answer},
                                                    {"role": "user", "content": turns[1]}], max_tokens)
            return first, second

    return await asyncio.gather(*[one(c) for c in conversations])


def summarize(rows: list[dict]) -> dict:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = {"ttft_ms": med([r["received"] - r["called"] for r in rows]) * 1e3}
    out.update({f"{h}_ms": med([r[b] - r[a] for r in rows]) * 1e3 for h, a, b in HOPS})
    out.update({k: med([r[k] for r in rows]) for k in ("steps", "prompt_tokens", "cached_tokens")})
    return {k: round(v, 1) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    from bench.serve_load import DEFAULT_QUESTIONS, FIRST_ANSWER_TOKENS, load_conversations
    from serve.settings import SERVE_DTYPE, split_args

    p = argparse.ArgumentParser(prog="python -m bench.ttft_hops", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--first-answer-tokens", type=int, default=FIRST_ANSWER_TOKENS, help="as bench.serve_load's")
    p.add_argument("--configs", default="spec,spec-noshort,spec-nocache")
    p.add_argument("--dtype", default=SERVE_DTYPE,
                   help="default: the server's (auto: bf16 where the CPU runs it natively)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import ray

    from graphs.config import EngineConfig
    from graphs.ray_graph import RayEngine

    conversations = load_conversations(DEFAULT_QUESTIONS, args.conversations)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    report = {"concurrency": args.concurrency, "conversations": len(conversations), "configs": {}}
    try:
        for name in args.configs.split(","):
            kw, _ = split_args({"max_running_requests": 32, "dtype": args.dtype,
                                **({"prefix_cache": False} if "nocache" in name else {}),
                                **({"short_prefill_tokens": 0} if "noshort" in name else {})})
            engine = RayEngine(EngineConfig(**kw, backend="ray"))
            try:
                asyncio.run(_conversations(engine, conversations[:2], 2, 8))  # warm-up (other questions than timed)
                rows = asyncio.run(_conversations(engine, conversations, args.concurrency, args.max_tokens,
                                                  args.first_answer_tokens))
            finally:
                engine.shutdown()
            report["configs"][name] = {"first_turn": summarize([r[0] for r in rows]),
                                       "second_turn": summarize([r[1] for r in rows])}
            print(f"[ttft_hops] {name}: {report['configs'][name]}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
