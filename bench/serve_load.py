"""Load test of the HTTP server: streaming clients at bounded concurrency, over loopback.

    python -m bench.serve_load [--url http://127.0.0.1:8000 [--api-key KEY]]
        [--concurrency 1,4,16,32] [--requests N] [--max-tokens 64]
        [--configs none,spec] [--model NAME] [--questions ../shared/eval/spec_bench_question.jsonl]
        [--port 8200] [--out FILE]

Without --url it starts its own Ray and Serve and deploys one application per config side by
side (`none`: no speculation; `spec`: what `make serve` speculates with, the default model's
EAGLE-3 tree with its batch-size cutoff, NGRAM on other models),
each under its own route prefix, then takes the levels in turn, every config on each level
before the next level, so load from other processes on a shared machine hits them alike.
With --url it measures that one server.

Each request is a chat completion of one Spec-Bench first turn (categories interleaved, file
order), greedy, `stream: true` with `include_usage`. Per request: TTFT = first content chunk
minus send; TPOT = (last chunk - first content chunk) / (completion tokens - 1). Per level:
p50 / p99 of both, output tokens/s = completion tokens / wall time of the level, and the
acceptance length from the server's /metrics (output tokens per verify step, mean over the
level's requests). Greedy decoding is lossless, so every config generates the same tokens.

Prints the JSON to stdout (progress to stderr); --out also writes it to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_QUESTIONS = REPO_ROOT.parent / "shared" / "eval" / "spec_bench_question.jsonl"


def log(*args) -> None:
    print("[serve_load]", *args, file=sys.stderr, flush=True)


def load_prompts(path: str | Path, n: int) -> list[str]:
    """n first turns, categories interleaved (each category's questions in file order)."""
    by_cat: OrderedDict[str, list[str]] = OrderedDict()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                item = json.loads(line)
                by_cat.setdefault(item.get("category", "?"), []).append(item["turns"][0])
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out += [v[i] for v in by_cat.values() if i < len(v)]
        i += 1
    return out[:n]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---- one client request -------------------------------------------------------------------------


async def one_request(http: httpx.AsyncClient, base: str, model: str | None, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"].get("message")}
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or now
                    last = now
    if first is None:
        return {"error": "no content"}
    return {"ttft": first - sent, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens}


def scrape(http_sync: httpx.Client, base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = http_sync.get(f"{base}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def run_level(base: str, headers: dict, model: str | None, prompts: list[str], concurrency: int,
                    max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers, limits=limits) as http:
        async def bounded(prompt):
            async with sem:
                try:
                    return await one_request(http, base, model, prompt, max_tokens)
                except httpx.HTTPError as exc:
                    return {"error": f"{type(exc).__name__}: {exc}"}

        t0 = time.perf_counter()
        results = await asyncio.gather(*[bounded(p) for p in prompts])
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in ok)

    def ms(x):
        return None if x is None else round(1000 * x, 1)

    return {
        "requests": len(prompts), "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
        "tpot_ms_p50": ms(percentile(tpot, 50)), "tpot_ms_p99": ms(percentile(tpot, 99)),
        "output_tokens": tokens, "wall_s": round(wall, 2), "output_tokens_per_s": round(tokens / wall, 2),
    }


def measure_level(name: str, base: str, headers: dict, model: str | None, prompts: list[str], level: int,
                  max_tokens: int) -> dict:
    with httpx.Client(headers=headers) as http:
        before = scrape(http, base)
        result = asyncio.run(run_level(base, headers, model, prompts, level, max_tokens))
        after = scrape(http, base)
    count = after.get("specgraph_acceptance_length_count", 0) - before.get("specgraph_acceptance_length_count", 0)
    total = after.get("specgraph_acceptance_length_sum", 0) - before.get("specgraph_acceptance_length_sum", 0)
    result["acceptance_length"] = round(total / count, 3) if count else None
    log(f"{name:5s} c={level:<3d} {result['output_tokens']:5d} tok {result['wall_s']:7.2f} s "
        f"{result['output_tokens_per_s']:7.2f} tok/s  ttft p50 {result['ttft_ms_p50']} ms  "
        f"tpot p50 {result['tpot_ms_p50']} ms  accept {result['acceptance_length']}  errors {result['errors']}")
    if result["errors"]:
        log(f"  first error: {result['first_error']}")
    return result


# ---- servers started here -----------------------------------------------------------------------


def start_servers(args, names: list[str]) -> tuple[dict[str, dict], object]:
    """Deploy one application per config under /<name>; returns ({name: app args}, stop())."""
    from bench.serving import start_local_serve

    common = {"model": args.model, "max_running_requests": max(32, max(args.concurrency)),
              "max_queue": 4 * max(args.concurrency) + 16}
    if args.kv_slots:
        common["kv_slots"] = args.kv_slots
    configs = {}
    for name in names:
        # `spec` leaves speculation to the server's defaults (serve.settings.apply_spec_defaults).
        configs[name] = {**common, **({"speculative_algorithm": "NONE"} if name == "none" else {})}
    stop = start_local_serve({name: (config, f"/{name}") for name, config in configs.items()}, args.port,
                             spare_cpus=0.5 * len(configs) + 1)
    return configs, stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="measure this server instead of starting one per config")
    p.add_argument("--api-key", default=os.environ.get("SPECGRAPH_API_KEY"))
    p.add_argument("--served-model", default=None, help="model name to send (default: none sent)")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: max(2, concurrency) at each level)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--configs", default="none,spec", help="servers started here: none, spec (the server's default speculation)")
    p.add_argument("--model", default=None, help="model of the servers started here (default model)")
    p.add_argument("--kv-slots", type=int, default=None)
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.model is None:
        from models.registry import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    per_level = {c: args.requests or max(2, c) for c in args.concurrency}
    prompts = load_prompts(args.questions, max(per_level.values()) + 2)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    stop = None
    if args.url:
        targets = {"server": args.url.rstrip("/")}
        configs = {"server": {"url": args.url}}
    else:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = set(names) - {"none", "spec"}
        if unknown:
            p.error(f"--configs: unknown {sorted(unknown)} (known: none, spec)")
        configs, stop = start_servers(args, names)
        targets = {name: f"http://127.0.0.1:{args.port}/{name}" for name in names}
    try:
        for name, base in targets.items():  # warm up: first steps compile graphs, load kernels
            measure_level(name, base, headers, args.served_model, prompts[-2:], 2, 8)
        results: dict[str, dict[str, dict]] = {name: {} for name in targets}
        for level in args.concurrency:
            for name, base in targets.items():
                results[name][str(level)] = measure_level(name, base, headers, args.served_model,
                                                          prompts[: per_level[level]], level, args.max_tokens)
    finally:
        if stop is not None:
            stop()
    report = {
        "benchmark": "serve_load",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "model": args.model if not args.url else None,
        "max_tokens": args.max_tokens,
        "requests_per_level": {str(c): n for c, n in per_level.items()},
        "configs": configs,
        "results": results,
    }
    if "none" in results and len(results) > 1:
        report["speedup_output_tokens_per_s"] = {
            name: {lvl: round(r["output_tokens_per_s"] / results["none"][lvl]["output_tokens_per_s"], 3)
                   for lvl, r in levels.items() if results["none"][lvl]["output_tokens_per_s"]}
            for name, levels in results.items() if name != "none"}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
