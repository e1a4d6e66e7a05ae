"""Load test of the HTTP server: streaming clients at bounded concurrency, over loopback.

    python -m bench.serve_load [--url http://127.0.0.1:8000 [--api-key KEY]]
        [--workloads spec_bench,multi_turn,shared_prefix] [--concurrency 1,4,16,32] [--requests N]
        [--max-tokens 64] [--first-answer-tokens 512] [--configs none,spec,none-nocache,spec-nocache] [--model NAME]
        [--dtype auto] [--questions ../shared/eval/spec_bench_question.jsonl] [--port 8200] [--out FILE]

Without --url it starts its own Ray and Serve and deploys one application per config side by
side (`none`: no speculation; `spec`: what `make serve` speculates with, the default model's
EAGLE-3 tree with its batch-size cutoff, NGRAM on other models; a `-nocache` suffix turns the
prefix cache off, `-retokenize` re-tokenizes the replies a chat sends back, `-fcfs` prefills prompts in
arrival order rather than shortest first), each under its own
route prefix, then takes the levels in turn, every config on each level before the next level,
so load from other processes on a shared machine hits them alike. With --url it measures that one
server. One workload and one level run quickly:
`--workloads multi_turn --concurrency 4 --configs spec,spec-nocache`.

Workloads (Spec-Bench questions are evaluation data: nothing is tuned on them):
  spec_bench     each request one Spec-Bench first turn (categories interleaved, file order);
  multi_turn     each client a conversation: its first turn, answered in full as MT-bench does (up to
                 --first-answer-tokens), then, once that answer is back, the second turn after it
                 (--max-tokens); the second turns are what is timed;
  shared_prefix  Spec-Bench first turns under one ~1k-token system prompt (SYSTEM_PROMPT).
Every request is greedy, `stream: true` with `include_usage`. Per request: TTFT = first content
chunk minus send; TPOT = (last chunk - first content chunk) / (completion tokens - 1). Per level:
p50 / p99 of both, output tokens/s = completion tokens / wall time of the level, the acceptance
length and the prefix-cache hit rate (tokens) from the server's /metrics over the level, and the
KV usage once the level is over (0: every slot free or evictable again), and each request's prompt
tokens and TTFT (`prompt_tokens_ttft_ms`, submission order). Greedy decoding is lossless, so every
config generates the same tokens.

Prints the JSON to stdout (progress to stderr); --out also writes it and a PNG beside it.
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
WORKLOADS = ("spec_bench", "multi_turn", "shared_prefix")
CONFIGS = ("none", "spec", "none-nocache", "spec-nocache", "none-retokenize", "spec-retokenize", "none-fcfs",
           "spec-fcfs")
DEFAULT_QUESTIONS = REPO_ROOT.parent / "shared" / "eval" / "spec_bench_question.jsonl"
# multi_turn's first answer, max_tokens: MT-bench lets the model answer in full (up to 1024 tokens); the default
# model ends 7 of 16 first answers by itself within 512 and runs 8 on past 1024, so 512 keeps most whole answers
# at half the time.
FIRST_ANSWER_TOKENS = 512


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


def load_conversations(path: str | Path, n: int) -> list[list[str]]:
    """n two-turn questions' turns, categories interleaved as load_prompts does."""
    by_cat: OrderedDict[str, list[list[str]]] = OrderedDict()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                item = json.loads(line)
                if len(item["turns"]) >= 2:
                    by_cat.setdefault(item.get("category", "?"), []).append(item["turns"][:2])
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out += [v[i] for v in by_cat.values() if i < len(v)]
        i += 1
    return out[:n]


def level_items(items: list, offset: int, n: int) -> list:
    """The n items of a level that starts `offset` items into the workload, wrapping round only
    once the set runs out."""
    return [items[(offset + i) % len(items)] for i in range(n)]


def _system_prompt() -> str:
    """~1k tokens of assistant instructions (written here, not taken from any benchmark)."""
    topics = ["accuracy", "brevity", "tone", "safety", "formatting", "citations", "code", "math", "tables",
              "lists", "names", "dates", "units", "privacy", "uncertainty", "follow-ups", "languages", "examples",
              "summaries", "definitions", "comparisons", "steps", "warnings", "assumptions", "sources"]
    rules = [f"Rule {i + 1} ({t}): when a request touches on {t}, answer plainly, check every claim about {t} "
             f"twice, prefer short sentences, and say so when you are unsure rather than guessing."
             for i, t in enumerate(topics)]
    return "You are a careful, helpful assistant working for a small company. " + " ".join(rules)


SYSTEM_PROMPT = _system_prompt()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---- one client request -------------------------------------------------------------------------


async def one_request(http: httpx.AsyncClient, base: str, model: str | None, messages: list[dict],
                      max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    sent = time.perf_counter()
    first = last = None
    tokens, prompt_tokens, text = 0, None, []
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
                tokens, prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or now
                    last = now
                    text.append(choice["delta"]["content"])
    if first is None:
        return {"error": "no content"}
    return {"ttft": first - sent, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "prompt_tokens": prompt_tokens, "text": "".join(text)}


async def one_client_job(http, base: str, model: str | None, workload: str, item, max_tokens: int,
                         first_answer_tokens: int | None = None) -> dict:
    """One workload item: a request, or (multi_turn) a conversation whose second turn is timed (its
    first answer up to `first_answer_tokens`, default `max_tokens`)."""
    if workload == "spec_bench":
        return await one_request(http, base, model, [{"role": "user", "content": item}], max_tokens)
    if workload == "shared_prefix":
        return await one_request(http, base, model, [{"role": "system", "content": SYSTEM_PROMPT},
                                                     {"role": "user", "content": item}], max_tokens)
    first = await one_request(http, base, model, [{"role": "user", "content": item[0]}],
                              first_answer_tokens or max_tokens)
    if "error" in first:
        return first
    history = [{"role": "user", "content": item[0]}, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": item[1]}]
    second = await one_request(http, base, model, history, max_tokens)
    if "error" not in second:
        second["first_turn_ttft"] = first["ttft"]
        second["tokens"] += first["tokens"]
    return second


def scrape(http_sync: httpx.Client, base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = http_sync.get(f"{base}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def run_level(base: str, headers: dict, model: str | None, workload: str, items: list, concurrency: int,
                    max_tokens: int, first_answer_tokens: int | None = None) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers, limits=limits) as http:
        async def bounded(item):
            async with sem:
                try:
                    return await one_client_job(http, base, model, workload, item, max_tokens, first_answer_tokens)
                except httpx.HTTPError as exc:
                    return {"error": f"{type(exc).__name__}: {exc}"}

        t0 = time.perf_counter()
        results = await asyncio.gather(*[bounded(item) for item in items])
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    tokens = sum(r["tokens"] for r in ok)

    def ms(x):
        return None if x is None else round(1000 * x, 1)

    first_turn = [r["first_turn_ttft"] for r in ok if "first_turn_ttft" in r]
    prompts = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]
    return {
        "requests": len(items), "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
        "tpot_ms_p50": ms(percentile(tpot, 50)), "tpot_ms_p99": ms(percentile(tpot, 99)),
        "output_tokens": tokens, "wall_s": round(wall, 2), "output_tokens_per_s": round(tokens / wall, 2),
        **({"first_turn_ttft_ms_p50": ms(percentile(first_turn, 50))} if first_turn else {}),
        "prompt_tokens_p50": percentile(prompts, 50),  # multi_turn: the second turns' (history and all)
        # Per request in submission order: (prompt tokens, TTFT ms); where a level's TTFT comes from.
        "prompt_tokens_ttft_ms": [[r.get("prompt_tokens"), ms(r["ttft"])] if "error" not in r else None
                                  for r in results],
    }


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0) - before.get(name, 0)


def measure_level(name: str, base: str, headers: dict, model: str | None, workload: str, items: list, level: int,
                  max_tokens: int, first_answer_tokens: int | None = None) -> dict:
    with httpx.Client(headers=headers) as http:
        before = scrape(http, base)
        result = asyncio.run(run_level(base, headers, model, workload, items, level, max_tokens, first_answer_tokens))
        time.sleep(2.5)  # the engines push their gauges every second
        after = scrape(http, base)
    count = _delta(before, after, "specgraph_acceptance_length_count")
    result["acceptance_length"] = round(_delta(before, after, "specgraph_acceptance_length_sum") / count, 3) \
        if count else None
    queried = _delta(before, after, "specgraph_prefix_cache_queried_tokens_total")
    result["prefix_hit_rate"] = round(_delta(before, after, "specgraph_prefix_cache_hit_tokens_total") / queried, 3) \
        if queried else 0.0
    result["preemptions"] = _delta(before, after, "specgraph_num_preemptions_total")
    result["kv_usage_after"] = after.get("specgraph_kv_cache_usage")
    log(f"{workload} {name:12s} c={level:<3d} {result['output_tokens']:5d} tok {result['wall_s']:7.2f} s "
        f"{result['output_tokens_per_s']:7.2f} tok/s  ttft p50 {result['ttft_ms_p50']} ms  "
        f"tpot p50 {result['tpot_ms_p50']} ms  accept {result['acceptance_length']}  "
        f"hit {result['prefix_hit_rate']}  kv after {result['kv_usage_after']}  errors {result['errors']}")
    if result["errors"]:
        log(f"  first error: {result['first_error']}")
    return result


def plot(report: dict, path: Path) -> Path:
    """TTFT p50 and output tokens/s against clients, one panel pair per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["results"])
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        for name, levels in report["results"][workload].items():
            xs = [int(lvl) for lvl in levels]
            axes[0][col].plot(xs, [r["ttft_ms_p50"] for r in levels.values()], marker="o", label=name)
            axes[1][col].plot(xs, [r["output_tokens_per_s"] for r in levels.values()], marker="o", label=name)
        what = "second-turn " if workload == "multi_turn" else ""
        axes[0][col].set(title=workload, ylabel=f"{what}TTFT p50 (ms)", xscale="log", yscale="log")
        axes[1][col].set(xlabel="clients", ylabel="output tokens/s", xscale="log")
        axes[0][col].legend(fontsize=8)
    fig.suptitle(f"serve_load, {report['model']}, {report.get('dtype')}, max_tokens {report['max_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ---- servers started here -----------------------------------------------------------------------


def resolved_dtype(name: str) -> str:
    """What a server given dtype `name` runs on this machine ("auto" resolved)."""
    from graphs.config import EngineConfig

    return str(EngineConfig(dtype=name).torch_dtype).removeprefix("torch.")


def server_configs(args, names: list[str]) -> dict[str, dict]:
    """The app args of each named config: the server's defaults but for speculation and the cache."""
    common = {"model": args.model, "dtype": args.dtype, "max_running_requests": max(32, max(args.concurrency)),
              "max_queue": 4 * max(args.concurrency) + 16}
    if args.kv_slots:
        common["kv_slots"] = args.kv_slots
    configs = {}
    for name in names:
        # `spec` leaves speculation to the server's defaults (serve.settings.apply_spec_defaults).
        configs[name] = {**common, **({"speculative_algorithm": "NONE"} if name.startswith("none") else {}),
                         **({"prefix_cache": False} if name.endswith("-nocache") else {}),
                         **({"reply_ids_tokens": 0} if "-retokenize" in name else {}),
                         **({"prefill_order": "fcfs"} if name.endswith("-fcfs") else {})}
        if args.max_num_batched_tokens:
            configs[name]["max_num_batched_tokens"] = args.max_num_batched_tokens
    return configs


def start_servers(args, names: list[str]) -> tuple[dict[str, dict], object]:
    """Deploy one application per config under /<name>; returns ({name: app args}, stop())."""
    from bench.serving import start_local_serve

    configs = server_configs(args, names)
    stop = start_local_serve({name: (config, f"/{name}") for name, config in configs.items()}, args.port,
                             spare_cpus=0.5 * len(configs) + 1)
    return configs, stop


def build_parser() -> argparse.ArgumentParser:
    from serve.settings import SERVE_DTYPE

    p = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="measure this server instead of starting one per config")
    p.add_argument("--api-key", default=os.environ.get("SPECGRAPH_API_KEY"))
    p.add_argument("--served-model", default=None, help="model name to send (default: none sent)")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: max(2, concurrency) at each level)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--first-answer-tokens", type=int, default=FIRST_ANSWER_TOKENS,
                   help="multi_turn: the first answer's max_tokens (MT-bench lets the model answer in full)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--configs", default="none,spec,none-nocache,spec-nocache",
                   help="servers started here: none, spec (the server's default speculation), each with a "
                        "-nocache suffix for the prefix cache off, -retokenize for chat replies re-tokenized "
                        "(reply_ids_tokens 0), or -fcfs for prompts prefilled in arrival order")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the servers' prefill step budget")
    p.add_argument("--model", default=None, help="model of the servers started here (default model)")
    p.add_argument("--kv-slots", type=int, default=None)
    p.add_argument("--dtype", default=SERVE_DTYPE,
                   help="the servers' dtype (default: the server's own, auto: bf16 where the CPU runs it natively)")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    for flag in ("max_tokens", "first_answer_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.model is None:
        from models.registry import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if set(workloads) - set(WORKLOADS):
        p.error(f"--workloads: unknown {sorted(set(workloads) - set(WORKLOADS))} (known: {', '.join(WORKLOADS)})")
    per_level = {c: args.requests or max(2, c) for c in args.concurrency}
    # Every level takes items no earlier level took (while the set lasts: 80 conversations, 480 first
    # turns), so a level's cache hits are what its own workload shares, not an earlier level's turns.
    most = sum(per_level.values()) + 2
    items = {"spec_bench": load_prompts(args.questions, most), "shared_prefix": load_prompts(args.questions, most),
             "multi_turn": load_conversations(args.questions, most)}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    stop = None
    if args.url:
        targets = {"server": args.url.rstrip("/")}
        configs = {"server": {"url": args.url}}
    else:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = set(names) - set(CONFIGS)
        if unknown:
            p.error(f"--configs: unknown {sorted(unknown)} (known: {', '.join(CONFIGS)})")
        configs, stop = start_servers(args, names)
        targets = {name: f"http://127.0.0.1:{args.port}/{name}" for name in names}
    try:
        for name, base in targets.items():  # warm up: first steps compile graphs, load kernels
            measure_level(name, base, headers, args.served_model, "spec_bench", items["spec_bench"][-2:], 2, 8)
        results: dict[str, dict[str, dict[str, dict]]] = {w: {name: {} for name in targets} for w in workloads}
        for workload in workloads:
            offset = 0
            for level in args.concurrency:
                chosen = level_items(items[workload], offset, per_level[level])
                offset += per_level[level]
                for name, base in targets.items():
                    results[workload][name][str(level)] = measure_level(
                        name, base, headers, args.served_model, workload, chosen, level, args.max_tokens,
                        args.first_answer_tokens)
    finally:
        if stop is not None:
            stop()
    report = {
        "benchmark": "serve_load",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "model": args.model if not args.url else None,
        "dtype": None if args.url else f"{args.dtype} ({resolved_dtype(args.dtype)})",
        "max_tokens": args.max_tokens,
        "first_answer_tokens": args.first_answer_tokens,
        "requests_per_level": {str(c): n for c, n in per_level.items()},
        "configs": configs,
        "results": results,
    }
    if "none" in targets and len(targets) > 1:
        report["speedup_output_tokens_per_s"] = {
            w: {name: {lvl: round(r["output_tokens_per_s"] / by["none"][lvl]["output_tokens_per_s"], 3)
                       for lvl, r in levels.items() if by["none"][lvl]["output_tokens_per_s"]}
                for name, levels in by.items() if name != "none"}
            for w, by in results.items()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        log(f"plot: {plot(report, Path(args.out).with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
