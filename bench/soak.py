"""Soak of the HTTP server: many streaming clients for minutes, some hanging up mid-stream.

    python -m bench.soak [--streams 64] [--duration 300] [--max-tokens 64] [--disconnect-every 5]
        [--model NAME] [--served-model-name NAME] [--kv-slots N] [--port 8300]
        [--sample-s 5] [--warmup-s 30] [--out bench/results/soak.json]

Starts its own Ray and Serve with one application (the server's default speculation on the
default model unless told), then runs `--streams` clients at once for `--duration` seconds. Each
client sends greedy streamed completions back to back; every `--disconnect-every`-th client hangs
up each of its streams after a random number of chunks. Checks, each one a failure when broken
(exit status 1):

  * zero errors for the clients that stay (HTTP status, error events, streams without a
    finish_reason or `[DONE]`, connection errors);
  * the engine's free KV slot count back to its initial value once the load stops;
  * RSS of every process of the Ray session (the driver's Ray children: GCS, raylet, the Serve
    controller, proxy and replicas, the scheduler, target and draft actors) flat within
    `--rss-tolerance` (10%): each process's last sample against its first one after warm-up.

Outputs that differ from a request's unloaded greedy output are counted too (`mismatched`): on
floating point hardware batched matmuls may round differently, so they are reported, not failed.

Prints the JSON to stdout (progress to stderr); --out also writes it to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import httpx
import psutil

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
           "List five uses of copper.", "What is the capital of France? Answer in one sentence.",
           "Describe the water cycle to a child.", "Give three tips for writing clear emails."]


def log(*args) -> None:
    print("[soak]", *args, file=sys.stderr, flush=True)


@dataclass
class SoakConfig:
    streams: int = 64
    duration_s: float = 300.0
    max_tokens: int = 64
    disconnect_every: int = 5  # every k-th client hangs up mid-stream (0: none)
    sample_s: float = 5.0  # RSS sampling period
    warmup_s: float = 30.0  # RSS baseline is the first sample after this much load
    rss_tolerance: float = 0.10
    idle_timeout_s: float = 120.0  # how long the engine may take to drain after the load
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("streams", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("duration_s", "sample_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s ({self.warmup_s}) must be below duration_s ({self.duration_s})")


# ---- the clients ----------------------------------------------------------------------------------


def request_body(model: str | None, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if model:
        body["model"] = model
    return body


async def one_stream(http: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None) -> dict:
    """One streamed completion: {"text", "finish_reason", "done"} or {"hung_up": True} or {"error"}."""
    text, finish_reason, done, chunks = [], None, False, 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": f"error event: {chunk['error']}"}
            for choice in chunk.get("choices", []):
                text.append(choice["text"])
                finish_reason = choice["finish_reason"] or finish_reason
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after and finish_reason is None:
                return {"hung_up": True}  # leaving the block closes the connection mid-stream
    if finish_reason is None or not done:
        return {"error": f"stream ended without {'a finish_reason' if finish_reason is None else '[DONE]'}"}
    return {"text": "".join(text), "finish_reason": finish_reason, "done": done}


async def client(index: int, http: httpx.AsyncClient, url: str, model: str | None, prompts: list[str],
                 expected: dict[str, str], config: SoakConfig, deadline: float, tally: dict) -> None:
    rng = random.Random(config.seed * 100_003 + index)
    hangs_up = config.disconnect_every > 0 and index % config.disconnect_every == 0
    n = 0
    while time.monotonic() < deadline:
        prompt = prompts[(index + n) % len(prompts)]
        n += 1
        hang_up_after = rng.randint(1, max(1, config.max_tokens // 2)) if hangs_up else None
        try:
            result = await one_stream(http, url, request_body(model, prompt, config.max_tokens, True), hang_up_after)
        except httpx.HTTPError as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        if result.get("hung_up"):
            tally["hung_up"] += 1
        elif "error" in result:
            tally["hang_up_client_errors" if hangs_up else "errors"] += 1
            tally["first_errors"] = (tally["first_errors"] + [result["error"]])[:5]
        else:
            tally["completed"] += 1
            if result["text"] != expected[prompt]:
                tally["mismatched"] += 1


# ---- process memory ---------------------------------------------------------------------------------


def ray_processes() -> dict[int, str]:
    """Every process of the Ray session this driver started (its children: GCS, raylet, the
    workers): {pid: label}. A worker names itself "ray::<actor class>" (Ray's process title)."""
    labels = {}
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            title = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue
        # A worker's title also names the method it runs: "ray::TargetActor.forward_step".
        if title.startswith("ray::"):
            labels[proc.pid] = title.split()[0][5:].split(".")[0]
        elif proc.name().startswith("python"):  # Ray's helpers (log monitor, dashboard...) by script
            scripts = [Path(a).name for a in title.split() if a.endswith(".py")]
            labels[proc.pid] = scripts[0] if scripts else proc.name()
        else:  # gcs_server, raylet
            labels[proc.pid] = proc.name()
    return labels


def sample_rss(pids: dict[int, str]) -> dict[int, int]:
    out = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).memory_info().rss
        except psutil.Error:  # gone (an idle worker reaped, say): not part of this sample
            continue
    return out


def rss_report(samples: list[tuple[float, dict[int, int]]], labels: dict[int, str], tolerance: float) -> dict:
    """Per process alive from the first to the last sample: first/last/peak RSS in MiB, growth, and
    every sample (a plateau and a leak end alike; the series tells them apart)."""
    if len(samples) < 2:
        return {"processes": {}, "flat": False, "reason": "fewer than two samples"}
    first, last = samples[0][1], samples[-1][1]
    processes = {}
    for pid in sorted(set(first) & set(last)):
        peak = max(s[pid] for _, s in samples if pid in s)
        growth = last[pid] / first[pid] - 1.0
        processes[f"{labels.get(pid, '?')}:{pid}"] = {
            "first_mib": round(first[pid] / 2**20, 1), "last_mib": round(last[pid] / 2**20, 1),
            "peak_mib": round(peak / 2**20, 1), "growth": round(growth, 4), "flat": abs(growth) <= tolerance,
            "series_mib": [round(s[pid] / 2**20, 1) for _, s in samples if pid in s]}
    return {"processes": processes, "flat": all(p["flat"] for p in processes.values()),
            "gone": len(set(first) - set(last)), "new": len(set(last) - set(first))}


# ---- one soak ------------------------------------------------------------------------------------------


def expected_texts(url: str, headers: dict, model: str | None, prompts: list[str], max_tokens: int) -> dict:
    """Each prompt's greedy output with nothing else running (the reference for the loaded runs)."""
    out = {}
    with httpx.Client(headers=headers, timeout=300) as http:
        for prompt in prompts:
            response = http.post(f"{url}/v1/completions", json=request_body(model, prompt, max_tokens, False))
            response.raise_for_status()
            out[prompt] = response.json()["choices"][0]["text"]
    return out


def wait_idle(kv_stats: Callable[[], dict], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = kv_stats()
        if (stats["running"] == 0 and stats["waiting"] == 0 and stats["free_slots"] == stats["kv_slots"]) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def run_soak(url: str, headers: dict, model: str | None, prompts: list[str], config: SoakConfig,
             kv_stats: Callable[[], dict], processes: Callable[[], dict[int, str]] = ray_processes) -> dict:
    """Run the load against `url` and check it; `kv_stats()` returns the engine's stats
    ({"running", "waiting", "free_slots", "kv_slots"})."""
    expected = expected_texts(url, headers, model, prompts, config.max_tokens)
    before = wait_idle(kv_stats, config.idle_timeout_s)
    tally = {"completed": 0, "hung_up": 0, "errors": 0, "hang_up_client_errors": 0, "mismatched": 0,
             "first_errors": []}
    samples: list[tuple[float, dict[int, int]]] = []
    labels: dict[int, str] = {}
    sampler_errors: list[str] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sampler():  # a thread: the clients must not wait on psutil
        if stop.wait(config.warmup_s):
            return
        try:
            labels.update(processes())
            while True:
                samples.append((time.monotonic() - t0, sample_rss(labels)))
                if stop.wait(config.sample_s):
                    return
        except Exception as exc:  # noqa: BLE001 - reported as a failure of the run, not lost in a thread
            sampler_errors.append(f"{type(exc).__name__}: {exc}")

    async def load():
        limits = httpx.Limits(max_connections=config.streams + 8, max_keepalive_connections=config.streams + 8)
        async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as http:
            deadline = time.monotonic() + config.duration_s
            await asyncio.gather(*[client(i, http, url, model, prompts, expected, config, deadline, tally)
                                   for i in range(config.streams)])

    thread = threading.Thread(target=sampler, name="rss-sampler", daemon=True)
    thread.start()
    try:
        asyncio.run(load())
    finally:
        stop.set()
        thread.join()
    samples.append((time.monotonic() - t0, sample_rss(labels)))  # the last one, with the load over
    wall = time.monotonic() - t0
    after = wait_idle(kv_stats, config.idle_timeout_s)
    rss = rss_report(samples, labels, config.rss_tolerance)
    failures = [f"RSS sampling failed: {e}" for e in sampler_errors]
    if tally["errors"]:
        failures.append(f"{tally['errors']} errors for clients that stayed: {tally['first_errors']}")
    if tally["completed"] == 0:
        failures.append("no stream completed")
    if config.disconnect_every and tally["hung_up"] == 0:
        failures.append("no client hung up mid-stream")
    if after["free_slots"] != before["free_slots"] or after["running"] or after["waiting"]:
        failures.append(f"KV not back: free {after['free_slots']} of {after['kv_slots']} "
                        f"(initially {before['free_slots']}), running {after['running']}, waiting {after['waiting']}")
    if not rss["flat"]:
        grown = {k: v["growth"] for k, v in rss["processes"].items() if not v["flat"]}
        failures.append(f"RSS not flat within {config.rss_tolerance:.0%}: {grown or rss.get('reason')}")
    return {
        "config": asdict(config), "wall_s": round(wall, 1), **tally,
        "requests_per_s": round((tally["completed"] + tally["hung_up"]) / wall, 2),
        "kv_free_before": before["free_slots"], "kv_free_after": after["free_slots"], "kv_slots": after["kv_slots"],
        "rss_samples": len(samples), "rss": rss, "failures": failures, "ok": not failures,
    }


# ---- the server started here -------------------------------------------------------------------------


def start_server(args) -> tuple[str, Callable[[], dict], Callable[[], None]]:
    """Local Ray + Serve with one application; returns (url, kv_stats, stop)."""
    from ray import serve

    from bench.serving import start_local_serve
    from serve.settings import ENGINE_DEPLOYMENT

    app_args = {"max_running_requests": args.streams, "max_queue": 4 * args.streams + 16}
    for name in ("model", "kv_slots", "served_model_name", "speculative_algorithm", "draft_model"):
        if getattr(args, name) is not None:
            app_args[name] = getattr(args, name)
    stop = start_local_serve({"soak": (app_args, "/")}, args.port)
    try:
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name="soak")
    except BaseException:
        stop()
        raise
    return f"http://127.0.0.1:{args.port}", lambda: handle.stats.remote().result(), stop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=SoakConfig.streams)
    p.add_argument("--duration", type=float, default=SoakConfig.duration_s, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=SoakConfig.max_tokens)
    p.add_argument("--disconnect-every", type=int, default=SoakConfig.disconnect_every,
                   help="every k-th client hangs up mid-stream (0: none)")
    p.add_argument("--sample-s", type=float, default=SoakConfig.sample_s)
    p.add_argument("--warmup-s", type=float, default=None, help="load before the RSS baseline (default: 30, "
                   "or a tenth of --duration when that is shorter)")
    p.add_argument("--rss-tolerance", type=float, default=SoakConfig.rss_tolerance)
    p.add_argument("--model", default=None, help="default: the server's default model and speculation")
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--kv-slots", type=int, default=None)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    warmup = args.warmup_s if args.warmup_s is not None else min(SoakConfig.warmup_s, args.duration / 10)
    config = SoakConfig(streams=args.streams, duration_s=args.duration, max_tokens=args.max_tokens,
                        disconnect_every=args.disconnect_every, sample_s=args.sample_s, warmup_s=warmup,
                        rss_tolerance=args.rss_tolerance, seed=args.seed)
    url, kv_stats, stop = start_server(args)
    try:
        log(f"{config.streams} streams for {config.duration_s:.0f} s against {url}")
        result = run_soak(url, {}, args.served_model_name, PROMPTS, config, kv_stats)
    finally:
        stop()
    from models.registry import DEFAULT_MODEL

    report = {"benchmark": "soak", "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "model": args.model or DEFAULT_MODEL,
              "speculative_algorithm": args.speculative_algorithm or "server default", **result}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    for failure in result["failures"]:
        log("FAILED:", failure)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
