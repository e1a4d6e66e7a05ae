"""Throughput against batch size: where speculation stops paying, and whether adaptive speculation
(each step's tree size chosen from measured costs, `actors.cost_model`) keeps up with plain decoding
at every load while keeping the fixed constants' gain at small batches.

    python -m bench.concurrency [--levels 1,2,4,8,16,32,64] [--max-tokens 64] [--prompts short,long]
        [--dtypes float32,bfloat16] [--configs serve,serve+fixed/16] [--plot]

Each level keeps that many requests in flight (`--arrival closed`, the default: each finished request's
place goes to the next prompt at once, as vLLM's and SGLang's `--max-concurrency` clients do) until
`--rounds` prompts per place and at least `--prompts-per-level` in all have run, greedy, `ignore_eos`
(batch 1 is eight prompts one at a time by default: one prompt's acceptance decided a batch-1 figure
before). `--arrival wave` submits the level's prompts at once and waits for all before the next wave:
plain decoding then finishes a wave's requests in the same step, while speculation spreads them (each
request accepts at its own rate) and runs the wave's last steps on the few stragglers, at a small
batch's cost per token; a server under steady load refills those places (docs/benchmarks.md, session 18).
Prompts: `short`, held-out self-written ones (`train.data.EVAL_SEED`, never
Spec-Bench, so a cutoff picked from this run is not tuned on the evaluation set); `long`, the
Spec-Bench summarization and RAG questions (long contexts, where verify rows cost the most;
`--questions`). Configs are those of `bench.configs`: `NAME+fixed/B@N` is NAME with full trees every
step (no adaptive choice), `verify_budget=B` and `disable_by_batch_size=N` (each part optional);
`serve` is the `make serve` config, `serve+fixed/16` what it ran before adaptive speculation. Every
config is loaded first in every dtype, and at each level they take turns, in an order reversed every
other turn, so load from other processes and the machine's drift hit them alike: compare ratios within
one run. `--interleave slices` (the default for local engines, closed arrival): every engine keeps its
level in flight and they take turns `--slice-s` seconds at a time (at least `--min-slices` each, and until
each has finished the level's prompts), timing the level's steady state only, each engine up to the same
count of finished requests (`timed_requests`: the same prompts for all); `turns`: each config runs
the level's prompts whole in its turn, `--repeats` rounds (the Ray backend, waves). The host's speed
moves within seconds: identical engines read up to 11% apart over six ~7 s turns each and within 1.3%
over twenty 1 s slices (docs/benchmarks.md, session 29); on a noisier host, a second `none` engine in the
same run (`--configs ...,none+fixed`: `none` again, in a process of its own) read 0.98-1.08x `none` at ten of
twelve levels, and 1.45-1.47x at the two where `none`'s own engine ran slow (session 44): name it beside the
configs to read each cell against the run's own noise floor. Output tokens must equal `none`'s in the same
dtype (greedy speculation is lossless); differing requests (finished by both) are counted. Results are
grouped "PROMPTS-DTYPE"; each entry also holds the decode steps per tree size the engine chose
(`tree_sizes`), where a local engine's time went step by step (`step_profile`: per step kind and tree
size, the steps, their share of the time, median step, prompt tokens carried, tokens per request; see
`StepProfile`) and this process's CPU milliseconds per output token (`cpu_ms_per_token`, local backend:
every thread of the engine) with its ratio to `none`'s (`cpu_ratio`), which separates another process's
load from the engine's own (a slower host, whose memory other machines share, slows both alike). Engines are built (and their
start-up cost probe, `actors.cost_probe`, run) before anything is timed. A quick subset:
`--levels 1,16 --prompts short --dtypes float32 --max-tokens 32 --repeats 1`; the issue's full run:
`--levels 1,2,4,8,16,32,64 --prompts short,long --dtypes float32,bfloat16 --configs serve,serve+fixed/16
--max-tokens 64 --repeats 2 --plot`. Every engine's KV pool holds the largest level of the longest
prompt at once, so that run's six engines want ~24 GB for 64 long prompts; on a 24 GB machine run the
short prompts at every level and the long ones up to 16 as two commands (9 and 7 minutes on the
2-core CPU, docs/benchmarks.md "Session 11"). Each local engine runs in a process of its own
(`bench.engine_process`; `--no-engine-processes`: all in this one): in one process, engines built
earlier step slower, by up to 5%.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import random
import shlex
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from bench.configs import REFERENCE, add_engine_args, kv_slots_for, parse_config
from bench.engine_process import start_engine
from bench.spec_bench import DEFAULT_QUESTIONS, load_questions, messages
from graphs import SamplingParams
from graphs.chat_ids import encode_chat
from graphs.engine import LocalEngine
from models.build import ModelSource, load_tokenizer
from train.data import EVAL_SEED, build_prompt_set

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "concurrency.json"
SLICE_S = 1.0  # `--interleave slices`: seconds an engine runs before the next one's turn
MIN_SLICES = 16  # and at least this many slices each per level and prompt set


class StepProfile:
    """Where a level's time went, step by step: per step kind and verified nodes per request ("decode/2",
    "mixed/1", "prefill/0"), the steps, their share of the time, their median and mean seconds, the prompt tokens
    they carried and the output tokens per request in them (median and mean: a size whose steps pause
    now and then differ there). A config that loses to `none` at a level loses
    it somewhere in this table: in its decode steps (trees that do not pay), in its mixed steps (prompts
    riding in drafting steps, which a closed loop of equal lengths spreads over many steps once requests
    accept at different rates, where `none` prefills a whole wave at once), or in rare dear steps
    (measuring a full tree, a catch-up): docs/benchmarks.md, session 34."""

    def __init__(self):
        # key -> (seconds, prompt, tokens, requests, context: the requests' committed tokens)
        self.steps: dict[str, list[tuple[float, int, int, int, int]]] = {}

    def add(self, plan, seconds: float, tokens: int) -> None:
        nodes = int(plan.meta.verify_slots.shape[1]) if plan.kind in ("decode", "mixed") else 0
        prompt = int(plan.meta.prefill_lens.sum())
        self.steps.setdefault(f"{plan.kind}/{nodes}", []).append(
            (seconds, prompt, tokens, len(plan.requests), int(plan.meta.seq_lens.sum())))

    @classmethod
    def combined(cls, profiles) -> "StepProfile":
        out = cls()
        for profile in profiles:
            for key, rows in profile.steps.items():
                out.steps.setdefault(key, []).extend(rows)
        return out

    def summary(self) -> dict:
        total = sum(r[0] for rows in self.steps.values() for r in rows) or 1.0
        return {key: {"steps": len(rows), "time_share": round(sum(r[0] for r in rows) / total, 4),
                      "median_ms": round(1e3 * statistics.median(r[0] for r in rows), 2),
                      "mean_ms": round(1e3 * statistics.fmean(r[0] for r in rows), 2),
                      "requests_per_step": round(sum(r[3] for r in rows) / len(rows), 1),
                      "context_per_request": round(sum(r[4] for r in rows) / max(1, sum(r[3] for r in rows)), 1),
                      "prompt_tokens_per_step": round(sum(r[1] for r in rows) / len(rows), 1),
                      "tokens_per_request_step": round(sum(r[2] for r in rows) / max(1, sum(r[3] for r in rows)), 3)}
                for key, rows in sorted(self.steps.items())}


class ClosedLoop:
    """One local engine's closed loop at a level: `level` requests in flight, each finished one's place
    going to the next prompt before the next step. `repeat`: the prompts start over when they run out, and
    the loop pauses between slices (`--interleave slices`): its requests stay in flight while another
    engine runs a slice, so every slice is the level's steady state, not a ramp-up or a drain; else
    `run_out` runs each prompt once (`run_level`)."""

    def __init__(self, engine, conversations: list[list[dict]], level: int, max_tokens: int | list[int],
                 repeat: bool = True):
        self.engine, self.scheduler, self.level, self.repeat = engine, engine.scheduler, level, repeat
        self.prompts = [engine.encode_chat(c) for c in conversations]
        self.params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                       for n in per_prompt(max_tokens, len(self.prompts))]
        self.submitted = 0
        self.active: dict[int, tuple] = {}  # submission index -> (Request, its output tokens counted)
        self.finished: dict[int, object] = {}  # submission index -> RequestOutput
        self.sizes = tree_sizes(engine)
        self.profile = StepProfile()
        # The timed steps' running totals (wall s, CPU s, output tokens), and a copy of them at each request
        # the timed steps finished (`run_slice`): where `_slices` cuts every engine at the same work.
        self.timed = (0.0, 0.0, 0)
        self.marks: list[tuple[float, float, int]] = []
        self._plan = None  # the step's plan, as the scheduler made it (`_planned`)

    def _planned(self, plan_fn):
        self._plan = plan_fn()
        return self._plan

    def step(self) -> tuple[int, int]:
        """Fill the free places, run one engine step; the output tokens it produced, and the requests it finished."""
        while len(self.active) < self.level and (self.repeat or self.submitted < len(self.prompts)):
            i = self.submitted % len(self.prompts)
            self.active[self.submitted] = (self.scheduler.find(self.scheduler.add_request(self.prompts[i], self.params[i])), 0)
            self.submitted += 1
        # The step's plan, for the profile: the scheduler keeps none once it has committed. A plan the
        # caller put on the instance (a test's wrapper) is wrapped and put back.
        self._plan = None
        plan_fn, own = self.scheduler.plan, vars(self.scheduler).get("plan")
        self.scheduler.plan = partial(self._planned, plan_fn)
        start = time.perf_counter()
        try:
            self.scheduler.step()
        finally:
            if own is None:
                del self.scheduler.plan  # the class's own again
            else:
                self.scheduler.plan = own
        seconds = time.perf_counter() - start
        tokens, done = 0, 0
        for i, (request, counted) in list(self.active.items()):
            tokens += len(request.output_ids) - counted
            if request.finish_reason is None:
                self.active[i] = (request, len(request.output_ids))
                continue
            out = self.finished[i] = request.output()
            del self.active[i]
            done += 1
            if out.error:
                raise RuntimeError(f"request failed: {out.error}")
        if self._plan is not None:
            self.profile.add(self._plan, seconds, tokens)
        return tokens, done

    def ramp_up(self) -> None:
        """Untimed steps until every place holds a decoding request (or the first one ends)."""
        self.step()
        while (self.scheduler.waiting or self.scheduler.prefilling) and not self.finished:
            self.step()
        self.sizes = tree_sizes(self.engine)
        self.profile = StepProfile()  # the steady state's steps only

    def run_slice(self, seconds: float) -> dict:
        """Steps for at least `seconds`: their wall and CPU seconds, output tokens, requests finished so far
        (the timed steps' `marks` get the running totals at each one they finish)."""
        start, cpu, tokens = time.perf_counter(), time.process_time(), 0
        while True:
            step_start, step_cpu = time.perf_counter(), time.process_time()
            new, done = self.step()
            tokens += new
            wall, cpu_s, total = self.timed
            self.timed = (wall + time.perf_counter() - step_start, cpu_s + time.process_time() - step_cpu, total + new)
            self.marks.extend([self.timed] * done)
            if time.perf_counter() - start >= seconds:
                break
        return {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "tokens": tokens,
                "finished": len(self.finished)}

    def run_out(self) -> list:
        """Without `repeat`: steps until every prompt has run; their RequestOutputs in prompt order."""
        while self.active or self.submitted < len(self.prompts):
            self.step()
        return [self.finished[i] for i in range(len(self.prompts))]

    def close(self) -> dict:
        """Abort what is in flight; the finished requests' tokens, verify steps and token ids (by submission
        index), the decode steps per tree size and the step profile (`StepProfile`) since the ramp-up."""
        after = tree_sizes(self.engine)
        for request, _ in self.active.values():
            self.scheduler.abort(request.rid)
        while self.scheduler.has_unfinished():
            self.scheduler.step()
        outs = self.finished
        return {"marks": self.marks, "tokens": sum(o.num_output_tokens for o in outs.values()),
                "steps": sum(o.num_verify_steps for o in outs.values()),
                "token_ids": {i: list(o.token_ids) for i, o in outs.items()},
                "tree_sizes": {k: n - self.sizes.get(k, 0) for k, n in after.items() if n > self.sizes.get(k, 0)},
                "profile": self.profile}


def per_prompt(max_tokens: int | list[int], count: int) -> list[int]:
    """Each prompt's output length: `max_tokens` for all, or its own (`request_lengths`)."""
    return [max_tokens] * count if isinstance(max_tokens, int) else list(max_tokens)[:count]


def request_lengths(max_tokens: int, spread: float, count: int) -> list[int]:
    """`count` prompts' output lengths: `max_tokens` each, or with `spread` > 0 drawn evenly from
    max_tokens x [1 - spread, 1 + spread], the same for every config (seeded), so outputs still compare
    request for request. With one length for all, a closed loop of plain decoding finishes its whole
    batch in one step and prefills the next batch together, which no server's traffic does: a config
    whose requests finish steps apart (speculation, each request accepting at its own rate) then
    carries its prompts one or two at a time in its decode steps (docs/benchmarks.md, session 34)."""
    if spread <= 0:
        return [max_tokens] * count
    rng = random.Random(0)
    return [max(1, round(max_tokens * (1.0 - spread + 2.0 * spread * rng.random()))) for _ in range(count)]


def run_level(engine, conversations: list[list[dict]], level: int, max_tokens: int | list[int]) -> dict:
    """`conversations` through `engine` with `level` requests in flight (all of them: one wave): a finished
    request's place goes to the next prompt before the next step (local backend) or as soon as its result
    is back (Ray). Wall and CPU seconds, tokens, verify steps, token ids in prompt order, and the decode
    steps per tree size the engine chose meanwhile, and (local backend) its step profile (`StepProfile`)."""
    before = tree_sizes(engine)
    if isinstance(engine, LocalEngine):
        loop = ClosedLoop(engine, conversations, level, max_tokens, repeat=False)
        start, cpu = time.perf_counter(), time.process_time()
        outs = loop.run_out()
        profile = loop.profile
    else:
        import ray

        prompts = [engine.encode_chat(c) for c in conversations]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in per_prompt(max_tokens, len(prompts))]
        outs: list = [None] * len(prompts)
        profile = StepProfile()  # the steps run in the scheduler actor, not timed here
        start, cpu = time.perf_counter(), time.process_time()
        pending: dict = {}
        for i, ids in enumerate(prompts):
            if len(pending) == level:
                done, _ = ray.wait(list(pending), num_returns=1)
                outs[pending.pop(done[0])] = ray.get(done[0])
            pending[engine.scheduler.generate.remote(ids, params[i])] = i
        for ref, i in pending.items():
            outs[i] = ray.get(ref)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    for out in outs:
        if out.error:
            raise RuntimeError(f"request failed: {out.error}")
    after = tree_sizes(engine)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(o.num_output_tokens for o in outs),
            "steps": sum(o.num_verify_steps for o in outs), "token_ids": [list(o.token_ids) for o in outs],
            "tree_sizes": {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)},
            "profile": profile}


def tree_sizes(engine) -> dict[int, int]:
    """Decode steps so far per tree size the engine chose (summed over ranks)."""
    if isinstance(engine, LocalEngine):
        return dict(engine.scheduler.policy.stats.steps_by_size)
    import ray

    return {int(k): n for k, n in ray.get(engine.scheduler.stats.remote())["steps_by_tree_size"].items()}


_LOOPS: dict[int, ClosedLoop] = {}  # engine id -> its loop, in the engine's process


def open_loop(engine, conversations: list[list[dict]], level: int, max_tokens: int | list[int]) -> None:
    loop = _LOOPS[id(engine)] = ClosedLoop(engine, conversations, level, max_tokens)
    loop.ramp_up()


def run_slice(engine, seconds: float) -> dict:
    return _LOOPS[id(engine)].run_slice(seconds)


def close_loop(engine) -> dict:
    return _LOOPS.pop(id(engine)).close()


def waves(level: int, prompts_per_level: int) -> int:
    """Waves of `level` prompts at once a level runs: enough for `prompts_per_level` prompts, so batch 1
    is not one prompt's acceptance."""
    return max(1, math.ceil(prompts_per_level / level))


def level_runs(level: int, prompts_per_level: int, arrival: str = "closed", rounds: int = 3) -> list[tuple[int, int]]:
    """A level's turns as (prompts, requests in flight): `wave`, its waves of `level` prompts each; `closed`,
    one turn of `rounds` prompts per place (at least `prompts_per_level`) with `level` in flight."""
    if arrival == "wave":
        return [(level, level)] * waves(level, prompts_per_level)
    return [(max(prompts_per_level, rounds * level), level)]


def turn_order(keys: list, turn: int) -> list:
    """The order configs run in on `turn`: reversed every other turn (A B C, C B A, ...), so a machine
    that speeds up or slows down over a level's turns hits every config alike."""
    return list(keys) if turn % 2 == 0 else list(reversed(keys))


def warm_up(conversation: list[dict], engine) -> None:
    """A few tokens through a freshly built engine, before anything is timed."""
    engine.chat([conversation], SamplingParams(max_tokens=4, temperature=0.0))


def measure(configs: dict, levels: list[int], prompt_sets: dict[str, list[list[dict]]], max_tokens: int | list[int],
            repeats: int, prompts_per_level: int = 1, arrival: str = "closed", rounds: int = 3,
            threads: int | None = None, engine_processes: bool = True, interleave: str = "turns",
            slice_s: float = SLICE_S, min_slices: int = MIN_SLICES) -> dict:
    """{"PROMPTS-DTYPE": {config: {level: {tokens_per_s, wall_s, acceptance_length, speedup, mismatches,
    tree_sizes, requests}}}}. `configs`: {(dtype, name): EngineConfig}; `max_tokens`: every request's, or
    each prompt's (`request_lengths`). Configs take turns at each level
    (`_turns` or `_slices`, by `interleave`); tokens/s is total tokens over total wall time, speedup is over
    `none` in the same dtype and prompts; each request's tokens are checked against `none`'s of the same
    prompt. Engines are built one at a time (each one's start-up cost probe alone on the machine), local
    ones each in a process of their own with `threads` unless `engine_processes` is False (`start_engine`)."""
    engines = {}
    try:
        warm = partial(warm_up, next(iter(prompt_sets.values()))[0])
        for key, config in configs.items():
            engines[key] = start_engine(config, threads, warm, engine_processes)
        results: dict[str, dict] = {}
        for level in levels:
            if interleave == "slices":
                totals = _slices(engines, level, prompt_sets, max_tokens, max(prompts_per_level, rounds * level),
                                 slice_s, min_slices)
            else:
                totals = _turns(engines, level, prompt_sets, max_tokens, repeats, prompts_per_level, arrival, rounds)
            for (kind, dtype, name), total in totals.items():
                entry = _entry(total, totals[(kind, dtype, REFERENCE)])
                results.setdefault(f"{kind}-{dtype}", {}).setdefault(name, {})[str(level)] = entry
                print(f"[concurrency] {level:3d} requests {kind}-{dtype} {name:24s} {entry['tokens_per_s']:8.2f} tok/s  "
                      f"x{entry['speedup']:.2f}  cpu x{entry['cpu_ratio']:.2f}  accept {entry['acceptance_length']:.2f}  "
                      f"sizes {entry['tree_sizes']}", file=sys.stderr)
        return results
    finally:
        for engine in engines.values():
            engine.shutdown()


def _turns(engines: dict, level: int, prompt_sets: dict, max_tokens: int | list[int], repeats: int, prompts_per_level: int,
           arrival: str, rounds: int) -> dict:
    """Each config runs the level's `level_runs` whole in its turn, every repeat, prompt set and dtype
    (`turn_order`). {(kind, dtype, name): totals (`_entry`)}."""
    runs = {(kind, *key): [] for kind in prompt_sets for key in engines}
    turn = 0
    for _ in range(repeats):
        first = 0
        for count, in_flight in level_runs(level, prompts_per_level, arrival, rounds):
            for kind, conversations in prompt_sets.items():
                batch = conversations[first:first + count]
                lengths = per_prompt(max_tokens, len(conversations))[first:first + count]
                for key in turn_order(list(engines), turn):
                    runs[(kind, *key)].append(engines[key].call(run_level, batch, in_flight, lengths))
                turn += 1
            first += count
    totals = {}
    for key, rs in runs.items():
        sizes: dict[int, int] = {}
        for r in rs:
            for k, n in r["tree_sizes"].items():
                sizes[k] = sizes.get(k, 0) + n
        tokens = sum(r["tokens"] for r in rs)
        totals[key] = {"tokens": tokens, "wall_s": sum(r["wall_s"] for r in rs), "cpu_s": sum(r["cpu_s"] for r in rs),
                       "finished_tokens": tokens, "steps": sum(r["steps"] for r in rs), "tree_sizes": sizes,
                       "token_ids": dict(enumerate(ids for r in rs for ids in r["token_ids"])),
                       "profile": StepProfile.combined(r["profile"] for r in rs)}
    return totals


def _slices(engines: dict, level: int, prompt_sets: dict, max_tokens: int | list[int], requests: int, slice_s: float,
            min_slices: int) -> dict:
    """Every engine keeps a closed loop of `level` requests (`ClosedLoop`) and they take turns in slices of
    `slice_s` seconds (`turn_order`), at least `min_slices` each and until each has finished `requests`
    requests; each engine's totals stop at the request all of them finished last (`ClosedLoop.marks`), so
    every engine is timed over the same prompts. The host's speed moves within seconds (three identical `none` engines read 248-369 tokens/s
    in turns of ~7 s each, 0.89-1.01x of each other over six turns; in 20 slices of 1 s, within 1.3%:
    docs/benchmarks.md, session 29), so many short alternations average it out where two long turns
    cannot. {(kind, dtype, name): totals (`_entry`)}."""
    totals = {}
    for kind, conversations in prompt_sets.items():
        for key in engines:
            engines[key].call(open_loop, conversations, level, max_tokens)
        timed = {key: [] for key in engines}
        turn = 0
        while turn < min_slices or min(ts[-1]["finished"] for ts in timed.values()) < requests:
            for key in turn_order(list(engines), turn):
                timed[key].append(engines[key].call(run_slice, slice_s))
            turn += 1
        closed = {key: engines[key].call(close_loop) for key in engines}
        # Every engine counted up to its `cut`-th finished request (in submission order, prompts alike), not to
        # the end of its last slice: a faster engine runs further down the prompt list, and where one prompt's
        # prefill is seconds (long prompts), engines cut at different prompts read up to ~10% apart on the
        # prefills they happened to time (docs/benchmarks.md, session 39).
        cut = min(len(c["marks"]) for c in closed.values())
        for key, ts in timed.items():
            c = closed[key]
            wall, cpu, tokens = c["marks"][cut - 1] if cut else (sum(t["wall_s"] for t in ts),
                                                             sum(t["cpu_s"] for t in ts), sum(t["tokens"] for t in ts))
            totals[(kind, *key)] = {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "cut": cut,
                                    "finished_tokens": c["tokens"], "steps": c["steps"], "tree_sizes": c["tree_sizes"],
                                    "token_ids": c["token_ids"], "slices": len(ts), "profile": c["profile"]}
    return totals


def _entry(total: dict, reference: dict) -> dict:
    """A config's figures at a level from its totals (timed tokens, wall and CPU seconds; finished requests'
    tokens, verify steps and token ids by prompt) against `none`'s: requests that both finished must
    match token for token (greedy speculation is lossless)."""
    tps = lambda t: t["tokens"] / t["wall_s"]  # noqa: E731
    cpu_per_token = lambda t: t["cpu_s"] / t["tokens"]  # noqa: E731
    ids, ref = total["token_ids"], reference["token_ids"]
    entry = {"tokens_per_s": tps(total), "wall_s": total["wall_s"], "speedup": tps(total) / tps(reference),
             "cpu_ms_per_token": 1e3 * cpu_per_token(total), "cpu_ratio": cpu_per_token(total) / cpu_per_token(reference),
             "acceptance_length": total["finished_tokens"] / max(1, total["steps"]),
             "mismatches": sum(ids[i] != ref[i] for i in ids.keys() & ref.keys())}
    return {**{k: round(v, 3) for k, v in entry.items()}, "requests": len(ids),
            **({"slices": total["slices"], "timed_requests": total["cut"]} if "slices" in total else {}),
            "tree_sizes": {str(k): n for k, n in sorted(total["tree_sizes"].items())},
            "step_profile": total["profile"].summary()}


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["meta"]["levels"]
    groups = list(result["results"])
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4.2 * len(groups)), squeeze=False)
    for row, group in zip(axes, groups):
        for name, per_level in result["results"][group].items():
            style = "--" if "+fixed" in name or "/" in name or "@" in name else "-"
            for ax, key in zip(row, ("tokens_per_s", "speedup")):
                ax.plot(levels, [per_level[str(n)][key] for n in levels], style, marker="o", label=name)
        for ax, label in zip(row, ("output tokens/s", f"speedup over '{REFERENCE}'")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(n) for n in levels])
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(label)
            ax.set_title(group, fontsize=9)
            ax.legend(fontsize=8)
        row[1].axhline(1.0, color="grey", linewidth=0.8)
        row[1].axhline(0.98, color="grey", linewidth=0.6, linestyle=":")
    meta = result["meta"]
    fig.suptitle(f"{meta['model']}, {meta['backend']} backend, {meta['threads']} threads, "
                 f"{meta['max_tokens']} tokens per request"
                 + (f" (each its own, \u00b1{meta['length_spread']:.0%})" if meta.get("length_spread") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="serve,serve+fixed/16")
    add_engine_args(p, draft_eagle3="smollm2-135m-instruct-eagle3", draft_standalone="smollm2-135m-instruct-standalone",
                    standalone_steps=3, dtype="auto")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="concurrent requests, comma-separated")
    p.add_argument("--prompts", default="short,long", help="prompt sets, comma-separated: short, long")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS),
                   help="Spec-Bench question.jsonl for the long prompts (its summarization and rag questions)")
    p.add_argument("--dtypes", default=None, help="comma-separated dtypes, each config in each (default: --dtype)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--length-spread", type=float, default=0.0,
                   help="each prompt's output length drawn from max_tokens x [1 - S, 1 + S] (the same for every "
                        "config); 0: every request max_tokens long")
    p.add_argument("--repeats", type=int, default=2, help="rounds of every config per level")
    p.add_argument("--engine-processes", action=argparse.BooleanOptionalAction, default=True,
                   help="each local engine in a process of its own (in one process, engines built earlier step "
                        "slower); --no-engine-processes: all in this one, for quick runs and profilers")
    p.add_argument("--prompts-per-level", type=int, default=8,
                   help="prompts each level runs at least (batch 1: this many one at a time)")
    p.add_argument("--arrival", default="closed", choices=("closed", "wave"),
                   help="closed: LEVEL requests in flight, the next prompt taking a finished one's place; "
                        "wave: LEVEL prompts at once, the next wave after the last of them")
    p.add_argument("--rounds", type=int, default=3, help="closed arrival: prompts per place at each level")
    p.add_argument("--interleave", default=None, choices=("slices", "turns"),
                   help="slices (the default for local engines and closed arrival): every engine keeps its level in "
                        "flight and they take turns for --slice-s seconds at a time; turns: each runs the level's "
                        "prompts whole in its turn, --repeats times (the Ray backend, wave arrival)")
    p.add_argument("--slice-s", type=float, default=SLICE_S, help="slices: seconds per turn")
    p.add_argument("--min-slices", type=int, default=MIN_SLICES, help="slices: turns per engine, at least")
    p.add_argument("--backend", default="local", choices=("local", "ray"),
                   help="ray: actors as `make serve` runs them (one CPU, so one thread, per actor)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--plot", action="store_true")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    if min(args.levels) < 1 or min(args.max_tokens, args.repeats, args.prompts_per_level, args.rounds) < 1:
        p.error("--levels, --max-tokens, --repeats, --prompts-per-level and --rounds must be positive")
    args.prompts = [k.strip() for k in args.prompts.split(",") if k.strip()]
    if not args.prompts or set(args.prompts) - set(PROMPT_SETS):
        p.error(f"--prompts: comma-separated among {', '.join(PROMPT_SETS)}, got {','.join(args.prompts)!r}")
    args.dtypes = [d.strip() for d in (args.dtypes or args.dtype).split(",") if d.strip()]
    sliceable = args.backend == "local" and args.arrival == "closed" and args.engine_processes
    if args.interleave is None:
        args.interleave = "slices" if sliceable else "turns"
    if args.interleave == "slices" and not sliceable:
        p.error("--interleave slices: local engines in processes of their own and closed arrival only")
    if not 0.0 <= args.length_spread < 1.0:
        p.error("--length-spread must be in [0, 1)")
    if args.slice_s <= 0 or args.min_slices < 1:
        p.error("--slice-s and --min-slices must be positive")
    return args


PROMPT_SETS = ("short", "long")
LONG_CATEGORIES = ("summarization", "rag")


def prompt_set(kind: str, count: int, questions: str) -> list[list[dict]]:
    """`count` conversations of one user message each (repeating the set where it holds fewer)."""
    if kind == "short":
        conversations = [p["messages"] for p in build_prompt_set(count, EVAL_SEED)]
    else:
        by_cat = load_questions(questions, count)
        conversations = [messages(q["prompt"]) for cat in LONG_CATEGORIES for q in by_cat.get(cat, [])]
        if not conversations:
            raise SystemExit(f"--questions: {questions} holds no {' or '.join(LONG_CATEGORIES)} questions")
    return [conversations[i % len(conversations)] for i in range(count)]


def level_kv_slots(model: str, conversations: list[list[dict]], level: int, max_tokens: int) -> int:
    """KV slots for `level` requests of the longest of `conversations` (chat-encoded) at once."""
    tokenizer = load_tokenizer(ModelSource.resolve(model).folder)
    return kv_slots_for([encode_chat(tokenizer, c, None) for c in conversations], level, max_tokens)


def whole_level(config, level: int):
    """`config` running every request of a `level` at once: at the engine's default `max_running_requests` (32),
    a level of 64 ran 32 requests and queued the rest (sessions up to 40 read their "64" cells so)."""
    return dataclasses.replace(config, max_running_requests=max(config.max_running_requests, level))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(dict.fromkeys([REFERENCE] + [n.strip() for n in args.configs.split(",") if n.strip()]))
    most = max(sum(count for count, _ in level_runs(level, args.prompts_per_level, args.arrival, args.rounds))
               for level in args.levels)
    prompt_sets = {kind: prompt_set(kind, most, args.questions) for kind in args.prompts}
    lengths = request_lengths(args.max_tokens, args.length_spread, most)
    if args.kv_slots is None:  # every request of the largest level at once
        args.kv_slots = level_kv_slots(args.model, [c for cs in prompt_sets.values() for c in cs], max(args.levels),
                                       max(lengths))
    configs = {}
    for dtype in args.dtypes:
        args.dtype = dtype
        for name in names:
            cfg = whole_level(dataclasses.replace(parse_config(name, args)[1], backend=args.backend), max(args.levels))
            configs[(str(cfg.torch_dtype).removeprefix("torch."), name)] = cfg
    if args.backend == "ray":
        import ray

        from graphs.runtime import graph_bundles

        # Logical CPUs for every config's actors at once (they share the machine's cores).
        needed = sum(b.get("CPU", 0) for cfg in configs.values() for b in graph_bundles(cfg))
        ray.init(address="local", num_cpus=math.ceil(needed) + 1, include_dashboard=False, log_to_driver=False)
    try:
        results = measure(configs, args.levels, prompt_sets, lengths, args.repeats, args.prompts_per_level,
                          args.arrival, args.rounds, args.threads, args.engine_processes, args.interleave,
                          args.slice_s, args.min_slices)
    finally:
        if args.backend == "ray":
            ray.shutdown()
    result = {
        "meta": {"model": args.model, "backend": args.backend, "levels": args.levels, "max_tokens": args.max_tokens,
                 "length_spread": args.length_spread,
                 "repeats": args.repeats, "prompts_per_level": args.prompts_per_level, "arrival": args.arrival,
                 "rounds": args.rounds, "prompts": args.prompts, "interleave": args.interleave,
                 "slice_s": args.slice_s, "min_slices": args.min_slices,
                 "engine_per_process": args.engine_processes and args.backend == "local",
                 "dtypes": [dtype for dtype, name in configs if name == REFERENCE],
                 "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "prompt_sources": {"short": f"train.data eval seed {EVAL_SEED}",
                                    "long": f"{Path(args.questions).name}: {', '.join(LONG_CATEGORIES)}"},
                 "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "command": "python -m bench.concurrency " + shlex.join(sys.argv[1:] if argv is None else argv)},
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
