"""Ray graph benchmark: the Ray backend against the local engine on the same cores, for NONE,
NGRAM and the `make serve` EAGLE-3 tree (and STANDALONE, named), each Ray run with the drafter
colocated in the target's actor and in its own actor.

    python -m bench.graph [--plot] [--quick] [--levers-only]

Per config, the local engine and every Ray placement are built side by side and measured in
turns (level by level, round by round, the order reversed every other round), so a busy machine
slows them alike; the figure to read is the same-run ratio Ray / local, taken per round and then
the median over rounds (`ratio_runs` in the JSON holds each round's). Same cores: the local engine
runs `--cores` torch threads; a Ray rank gets `--cores` CPUs in all (a draft model 1 of them, in
its own actor or, colocated, added to the target's threads).

Per-step profile at `--profile-batches`: where one step's wall time goes (scheduler plan, the
executor call, each actor's compute measured inside it, commit), and CPU seconds per process
per step, which shows a process that spins while it waits, and minor page faults per step (memory
the allocator maps afresh each step). Coordination = executor wall time
minus the actors' compute (in the local engine the executor is the compute). For the colocated
placement, `hops` splits the coordination into the hop's phases (bench.hops: the scheduler's send, the
actor's read, the hand-over to its compute thread, its write, the scheduler's wake-up and read).

Levers (skipped by --quick), same engine in turns: step inputs as deltas vs packed whole vs Ray's
pickler, and spinning vs sleeping channel reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

from bench import hops
from graphs import EngineConfig, SamplingParams, build_graph
from graphs.config import GRAPH_CHANNELS, OMP_WAIT_POLICIES
from graphs.runtime import draft_cpus
from serve.settings import DEFAULT_EAGLE3_DRAFT, DEFAULT_SPECULATION

PROMPTS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the sea.",
    "Give three tips for learning a new language.",
    "What are the main causes of inflation?",
    "Describe the water cycle in simple terms.",
    "List five fruits that are rich in vitamin C.",
    "How does a bicycle stay upright when moving?",
    "Summarize the plot of a heist movie you invent.",
]
CONFIGS = ("none", "ngram", "eagle3-tree")  # eagle3-tree: what `make serve` runs (serve.settings)
OTHER_CONFIGS = ("standalone",)  # by name only: the shipped small draft LM, 4 tokens a step
PLACEMENTS = ("colocated", "separate")
TIMED = ("step", "plan", "execute", "commit")


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]


def speculation(name: str, args) -> dict:
    if name == "none":
        return {}
    if name == "ngram":
        return {"speculative_algorithm": "NGRAM", "num_steps": 4}
    if name == "eagle3-tree":
        return {**DEFAULT_SPECULATION, "draft_model": args.draft_eagle3}
    if name == "standalone":
        return {"speculative_algorithm": "STANDALONE", "draft_model": args.draft_standalone, "num_steps": 4}
    raise SystemExit(f"--configs: unknown config {name!r} (known: {', '.join(CONFIGS + OTHER_CONFIGS)})")


def ray_key(placement: str, policy: str = "default", channel: str = "shm") -> str:
    return (f"ray/{placement}" + ("" if policy == "default" else f"/omp-{policy}")
            + ("" if channel == "shm" else f"/{channel}-channel"))


def variants(name: str, args) -> dict[str, EngineConfig]:
    """local, then ray/<placement> for each placement: the same engine on the same cores."""
    base = {"model": args.model, "dtype": args.dtype, "kv_slots": 8192, "max_running_requests": max(args.levels),
            **speculation(name, args)}
    local = EngineConfig(**base, num_threads=args.cores)
    draft = draft_cpus(local)  # 1 for a draft model (the default draft_num_cpus), 0 for a model-free drafter
    out = {"local": local}
    for placement in args.placements:
        for policy in args.omp_wait_policies:
            for channel in args.graph_channels:
                out[ray_key(placement, policy, channel)] = EngineConfig(
                    **base, backend="ray", draft_placement=placement, omp_wait_policy=policy, graph_channel=channel,
                    target_num_cpus=args.cores - draft, draft_num_cpus=draft)
    return out


# ---- instrumentation: timers installed on the live scheduler objects ------------------------


def _add_timer(obj, method: str, key: str, totals: dict) -> None:
    fn = getattr(obj, method)

    def timed(*a, **kw):
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            seconds, calls = totals.get(key, (0.0, 0))
            totals[key] = (seconds + time.perf_counter() - start, calls + 1)

    setattr(obj, method, timed)


def _install_in_scheduler_actor(actor_self) -> None:
    """Runs inside the SchedulerActor (via __ray_call__): time its step, plans, executor and commits."""
    totals = actor_self._bench_totals = {}
    _add_timer(actor_self.runtime, "step", "step", totals)
    _add_timer(actor_self.dp.executor, "execute_all", "execute", totals)
    for rank in actor_self.dp.ranks:
        _add_timer(rank, "plan", "plan", totals)
        _add_timer(rank, "commit", "commit", totals)


def _take_scheduler_actor_totals(actor_self) -> dict:
    out = dict(actor_self._bench_totals)
    actor_self._bench_totals.clear()
    return out


def _process_info(actor_self) -> dict:
    return {"pid": os.getpid(), "torch_threads": torch.get_num_threads()}


class Probe:
    """Step timers, actor compute and per-process CPU time of one engine."""

    def __init__(self, engine):
        self.engine = engine
        self.ray = engine.config.backend == "ray"
        if self.ray:
            ray.get(engine.scheduler.__ray_call__.remote(_install_in_scheduler_actor))
            self.actors = engine.actors()
            per_rank = ["target+draft"] if engine.config.colocated_draft else ["target", "draft"]
            self.kinds = per_rank * (len(self.actors) // len(per_rank))  # actors(): per rank, target then draft
            infos = ray.get([a.__ray_call__.remote(_process_info) for a in [engine.scheduler, *self.actors]])
            self.processes = {"scheduler": infos[0], **{k: i for k, i in zip(self.kinds, infos[1:])}}
            # The colocated placement's one hop per step, phase by phase (bench.hops), on rank 0.
            self.hops = engine.config.colocated_draft
            if self.hops:
                ray.get([engine.scheduler.__ray_call__.remote(hops.install_scheduler),
                         self.actors[0].__ray_call__.remote(hops.install_runner)])
        else:
            self.totals: dict = {}
            sched = engine.scheduler
            _add_timer(sched, "step", "step", self.totals)
            _add_timer(sched, "plan", "plan", self.totals)
            _add_timer(sched.executor, "execute", "execute", self.totals)
            _add_timer(sched, "commit", "commit", self.totals)
            self.processes = {"driver": {"pid": os.getpid(), "torch_threads": torch.get_num_threads()}}

    def _hop_stamps(self) -> tuple[list, list]:
        return tuple(ray.get([self.engine.scheduler.__ray_call__.remote(hops.take),
                              self.actors[0].__ray_call__.remote(hops.take)]))

    def _totals(self) -> dict:
        if self.ray:
            return ray.get(self.engine.scheduler.__ray_call__.remote(_take_scheduler_actor_totals))
        out = dict(self.totals)
        self.totals.clear()
        return out

    def _compute(self) -> dict:
        if not self.ray:
            return {}
        stats = ray.get([a.stats.remote(reset=True) for a in self.actors])
        out: dict = {}
        for kind, s in zip(self.kinds, stats):
            out[kind] = out.get(kind, 0.0) + s["compute_s"]
        return out

    def _cpu(self) -> dict:
        return {name: cpu_seconds(info["pid"]) for name, info in self.processes.items()}

    def _faults(self) -> dict:
        return {name: minor_faults(info["pid"]) for name, info in self.processes.items()}

    def run(self, batch: int, max_tokens: int) -> dict:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self._totals(), self._compute()
        hopping = self.ray and self.hops
        if hopping:
            self._hop_stamps()
        cpu0, faults0 = self._cpu(), self._faults()
        start = time.perf_counter()
        self.engine.chat(conversations(batch), params)
        wall = time.perf_counter() - start
        cpu1, faults1 = self._cpu(), self._faults()
        totals, compute = self._totals(), self._compute()
        steps = totals["step"][1]
        ms = {key: 1e3 * totals.get(key, (0.0, 0))[0] / steps for key in TIMED}
        compute_ms = {k: 1e3 * v / steps for k, v in compute.items()} or {"in-process": ms["execute"]}
        coordination = ms["execute"] - sum(compute_ms.values())
        out = {"hops": hops.summary(hops.phases(*self._hop_stamps()))} if hopping else {}
        return {**out, "batch": batch, "steps": steps, "wall_s": wall, **{f"{k}_ms": v for k, v in ms.items()},
                "compute_ms": compute_ms, "coordination_ms": coordination,
                "coordination_fraction": coordination / ms["step"],
                "cpu_ms_per_step": {k: 1e3 * (cpu1[k] - cpu0[k]) / steps for k in cpu0},
                "cpu_busy_fraction": {k: (cpu1[k] - cpu0[k]) / wall for k in cpu0},
                "minor_faults_per_step": {k: (faults1[k] - faults0[k]) / steps for k in faults0},
                "torch_threads": {k: v["torch_threads"] for k, v in self.processes.items()}}


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat fields after the command name (field 3 of proc(5) is index 0)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def minor_faults(pid: int) -> int:
    """Minor page faults of a process so far: memory the allocator keeps mapping afresh."""
    return int(_stat(pid)[7])


def throughput(engine, concurrency: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.chat(conversations(concurrency), params)
    wall = time.perf_counter() - start
    tokens = sum(o.num_output_tokens for o in outs)
    steps = sum(o.num_verify_steps for o in outs)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "acceptance_length": tokens / steps}


def measure_config(name: str, args) -> dict:
    configs = variants(name, args)
    engines = {}
    try:
        for key, cfg in configs.items():
            engines[key] = build_graph(cfg)
            engines[key].chat(conversations(2), SamplingParams(max_tokens=8, temperature=0.0))  # warm up
        probes = {key: Probe(engine) for key, engine in engines.items()}
        profile = {key: {} for key in engines}
        for batch in args.profile_batches:
            for key, probe in probes.items():
                profile[key][str(batch)] = probe.run(batch, args.max_tokens)
        runs = {key: {str(c): [] for c in args.levels} for key in engines}
        for r in range(args.rounds):
            for c in args.levels:
                # Interleaved, so a busy spell hits every variant, and in the reverse order every other
                # round, so neither engine is always the one that runs right after the other.
                order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
                for key, engine in order:
                    runs[key][str(c)].append(throughput(engine, c, args.max_tokens))
    finally:
        for engine in engines.values():
            engine.shutdown()
    tput = {key: {c: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                      "runs": [r["tokens_per_s"] for r in rs],
                      "acceptance_length": statistics.mean(r["acceptance_length"] for r in rs)}
                  for c, rs in per.items()} for key, per in runs.items()}
    # Ray / local per round, the two run back to back, then the median over rounds: the host's speed
    # drifts by tens of percent within minutes on a shared VM (docs/benchmarks.md, session 31), and a
    # ratio of each engine's median over rounds would compare one engine's fast round with the
    # other's slow one.
    paired = {key: {c: [ray_run["tokens_per_s"] / local_run["tokens_per_s"]
                        for ray_run, local_run in zip(runs[key][c], runs["local"][c])] for c in runs["local"]}
              for key in runs if key != "local"}
    ratio = {key: {c: statistics.median(rs) for c, rs in per.items()} for key, per in paired.items()}
    return {"throughput": tput, "ratio_vs_local": ratio, "ratio_runs": paired, "profile": profile}


def wait_levers(args) -> dict:
    """Spinning vs sleeping graph reads (EngineConfig.graph_wait_sleep_us, over Ray's channel: ours
    always sleeps on its doorbell), eagle3-tree, each engine alone (an idle spinning engine would
    steal the others' cores): CPU seconds each process burns in 2 s idle, and the step profile."""
    out = {}
    for placement in args.placements:
        for sleep_us in (0.0, EngineConfig.graph_wait_sleep_us):
            cfg = dataclasses.replace(variants("eagle3-tree", args)[ray_key(placement, args.omp_wait_policies[0], args.graph_channels[0])],
                                      graph_wait_sleep_us=sleep_us, graph_channel="ray")
            engine = build_graph(cfg)
            try:
                engine.chat(conversations(2), SamplingParams(max_tokens=8, temperature=0.0))  # warm up, compile
                probe = Probe(engine)
                before = probe._cpu()
                time.sleep(2.0)
                idle = {k: (v - before[k]) / 2.0 for k, v in probe._cpu().items()}
                key = f"ray/{placement}/{'spin' if sleep_us == 0 else f'sleep{sleep_us:g}us'}"
                out[key] = {"idle_cpu_fraction": idle,
                            **{str(b): probe.run(b, args.max_tokens) for b in args.profile_batches}}
                print(f"  {key}: idle CPU fraction {json.dumps({k: round(v, 2) for k, v in idle.items()})}; "
                      + "; ".join(f"b={b} step {out[key][str(b)]['step_ms']:.1f} ms coordination "
                                  f"{out[key][str(b)]['coordination_ms']:.2f} ms" for b in args.profile_batches),
                      flush=True)
            finally:
                engine.shutdown()
    return out


def _set_transport(actor_self, packed: bool, deltas: bool) -> None:
    """Runs in each process of a Ray engine: step batches packed (actors.wire) or through Ray's
    own pickler; the scheduler's step inputs as deltas over what the actors hold
    (actors.step_stream) or whole."""
    from actors import wire

    for cls in wire.WIRE_TYPES:
        ray.util.deregister_serializer(cls)
    if packed:
        wire.register()
    runtime = getattr(actor_self, "runtime", None)  # the scheduler actor's GraphRuntime
    for sender in getattr(runtime.executor, "senders", []) if runtime is not None else []:
        sender.holding = deltas


TRANSPORTS = {"deltas": (True, True), "packed": (True, False), "pickled": (False, False)}


def transport_levers(args) -> dict:
    """Same engine, same run, in turns: step inputs as deltas (actors.step_stream), step batches
    packed whole (actors.wire), and Ray's pickler. eagle3-tree and none, each placement, over Ray's channel."""
    out = {}
    for name in ("eagle3-tree", "none"):
        for placement in args.placements:
            # Over Ray's channel: the packing lever is whether Ray's serializer packs; ours always does.
            cfg = variants(name, args)[ray_key(placement, args.omp_wait_policies[0], args.graph_channels[0])]
            engine = build_graph(dataclasses.replace(cfg, graph_channel="ray"))
            try:
                engine.chat(conversations(2), SamplingParams(max_tokens=8, temperature=0.0))  # warm up, compile
                probe = Probe(engine)
                processes = [engine.scheduler, *probe.actors]
                runs: dict = {}
                for _ in range(args.rounds):
                    for mode, (packed, deltas) in TRANSPORTS.items():
                        ray.get([p.__ray_call__.remote(_set_transport, packed, deltas) for p in processes])
                        for b in args.profile_batches:
                            runs.setdefault(mode, {}).setdefault(str(b), []).append(probe.run(b, args.max_tokens))
                key = f"{name}/ray/{placement}"
                out[key] = {mode: {b: {"step_ms": statistics.median(r["step_ms"] for r in rs),
                                       "coordination_ms": statistics.median(r["coordination_ms"] for r in rs),
                                       "cpu_ms_per_step": rs[-1]["cpu_ms_per_step"], "runs": rs}
                                   for b, rs in per.items()} for mode, per in runs.items()}
                for mode, per in out[key].items():
                    print(f"  {key} {mode:16s} " + "; ".join(
                        f"b={b} step {p['step_ms']:.1f} ms coordination {p['coordination_ms']:.2f} ms CPU ms/step "
                        f"{json.dumps({k: round(v, 1) for k, v in p['cpu_ms_per_step'].items()})}"
                        for b, p in per.items()), flush=True)
            finally:
                engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft-eagle3", default=DEFAULT_EAGLE3_DRAFT, help="the EAGLE-3 head of eagle3-tree")
    parser.add_argument("--draft-standalone", default="smollm2-135m-instruct-standalone",
                        help="the draft LM of standalone (a config named only: --configs standalone)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--dtype", default="float32", help="every engine's dtype (`make serve` runs bfloat16 where "
                        "the CPU has native bf16)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=2,
                        help="throughput runs per level and variant (the ratio: median of per-round ratios)")
    parser.add_argument("--profile-batches", default="1,16")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="cores each engine gets")
    parser.add_argument("--omp-wait-policies", default="default",
                        help="the Ray variants' EngineConfig.omp_wait_policy, comma-separated (each its own variant)")
    parser.add_argument("--graph-channels", default="shm",
                        help="the Ray variants' EngineConfig.graph_channel, comma-separated (each its own variant)")
    parser.add_argument("--no-levers", action="store_true", help="skip the lever comparisons (reads, transport)")
    parser.add_argument("--levers-only", action="store_true", help="only the lever comparisons")
    parser.add_argument("--quick", action="store_true", help="1 round, levels 1,16, 16 tokens, no lever comparison")
    parser.add_argument("--out", default="bench/results/graph.json")
    parser.add_argument("--plot", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.concurrency, args.max_tokens, args.no_levers = 1, "1,16", 16, True
    args.levels = [int(x) for x in args.concurrency.split(",")]
    args.profile_batches = [int(x) for x in args.profile_batches.split(",")]
    args.placements = args.placements.split(",")
    for p in args.placements:
        if p not in PLACEMENTS:
            raise SystemExit(f"--placements: unknown placement {p!r} (known: {', '.join(PLACEMENTS)})")
    args.omp_wait_policies = args.omp_wait_policies.split(",")
    for p in args.omp_wait_policies:
        if p not in OMP_WAIT_POLICIES:
            raise SystemExit(f"--omp-wait-policies: unknown policy {p!r} (known: {', '.join(OMP_WAIT_POLICIES)})")
    args.graph_channels = args.graph_channels.split(",")
    for c in args.graph_channels:
        if c not in GRAPH_CHANNELS:
            raise SystemExit(f"--graph-channels: unknown channel {c!r} (known: {', '.join(GRAPH_CHANNELS)})")
    # alive at once, `--cores` CPUs each
    ray_variants = len(args.placements) * len(args.omp_wait_policies) * len(args.graph_channels)
    ray.init(address="local", num_cpus=max(8, args.cores * (1 + ray_variants)), include_dashboard=False, log_to_driver=False)
    result = {"meta": {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "cores": args.cores, "rounds": args.rounds,
                       "torch": torch.__version__, "ray": ray.__version__, "python": platform.python_version(),
                       "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                       "command": " ".join(["python -m bench.graph", *sys.argv[1:]])},
              "configs": {}}
    try:
        if not args.no_levers:
            result["transport_levers"] = transport_levers(args)
            result["wait_levers"] = wait_levers(args)
        for name in ([] if args.levers_only else args.configs.split(",")):
            result["configs"][name] = measure_config(name, args)
            print(summary(name, result["configs"][name]), flush=True)
    finally:
        ray.shutdown()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if args.plot and result["configs"]:
        plot(result, out.with_suffix(".png"))
    return result


def summary(name: str, res: dict) -> str:
    lines = [f"== {name}"]
    for key, per in res["throughput"].items():
        ratio = res["ratio_vs_local"].get(key)
        lines.append(f"  {key:15s} " + "  ".join(
            f"{c}: {v['tokens_per_s']:6.1f} tok/s" + (f" ({ratio[c]:.2f}x)" if ratio else "") for c, v in per.items()))
    for key, per in res["profile"].items():
        for batch, p in per.items():
            lines.append(f"  profile {key:15s} b={batch:>3s} step {p['step_ms']:6.1f} ms: plan {p['plan_ms']:.2f} "
                         f"execute {p['execute_ms']:.1f} (compute {sum(p['compute_ms'].values()):.1f}, coordination "
                         f"{p['coordination_ms']:.2f} = {100 * p['coordination_fraction']:.1f}%) commit "
                         f"{p['commit_ms']:.2f}; CPU ms/step {json.dumps({k: round(v, 1) for k, v in p['cpu_ms_per_step'].items()})}; "
                         f"minor faults/step {json.dumps({k: round(v) for k, v in p['minor_faults_per_step'].items()})}")
            if p.get("hops", {}).get("steps"):
                lines.append("      hops (median ms): " + ", ".join(f"{phase} {p['hops'][phase + '_ms']:.2f}"
                                                           for phase in hops.PHASES if phase != "compute")
                             + f"; coordination {p['hops']['coordination_ms']:.2f} over {p['hops']['steps']} steps")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 8), squeeze=False)
    for col, name in enumerate(names):
        res = result["configs"][name]
        top, bottom = axes[0][col], axes[1][col]
        for key, ratio in res["ratio_vs_local"].items():
            levels = [int(c) for c in ratio]
            top.plot(levels, list(ratio.values()), marker="o", label=key)
        top.axhline(1.0, color="gray", lw=0.8)
        top.axhline(0.95, color="gray", lw=0.8, ls="--")
        top.set(xscale="log", xlabel="concurrent requests", ylabel="throughput / local", title=name)
        top.legend()
        bars, labels = [], []
        for key, per in res["profile"].items():
            for batch, p in per.items():
                labels.append(f"{key}\nb={batch}")
                bars.append((p["plan_ms"] + p["commit_ms"], sum(p["compute_ms"].values()), p["coordination_ms"]))
        x = range(len(bars))
        sched = [b[0] for b in bars]
        comp = [b[1] for b in bars]
        coord = [b[2] for b in bars]
        bottom.bar(x, sched, label="plan + commit")
        bottom.bar(x, comp, bottom=sched, label="actor compute")
        bottom.bar(x, coord, bottom=[s + c for s, c in zip(sched, comp)], label="coordination")
        bottom.set_xticks(list(x), labels, fontsize=7)
        bottom.set(ylabel="ms per step", title=f"{name}: one step")
        bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
