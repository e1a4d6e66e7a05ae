"""Serving metrics as plain, mergeable snapshots, rendered as Prometheus text.

Each Serve replica keeps a `ServeMetrics` (counters, histogram buckets, gauges: plain
numbers, cheap to send through Ray), pushes `snapshot()` to a shared hub, and `/metrics`
renders the merge of all replicas' snapshots through prometheus_client on its own
CollectorRegistry. Counters and histograms add up across replicas; gauges add up over the
replicas that reported recently (KV usage is recomputed from the summed slot counts).
"""

from __future__ import annotations

import copy
import time
from bisect import bisect_left
from typing import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily

PREFIX = "specgraph"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)
GAUGE_TTL_S = 15.0  # a replica's gauges count only while it reports
# What each replica reports of its engine (graphs.scheduler_actor stats): the scheduler's state,
# and its running totals (preemptions, prefix-cache tokens, queue wait), which add up as gauges do.
ENGINE_GAUGES = {"running": 0, "waiting": 0, "free_slots": 0, "kv_slots": 0, "cached_slots": 0, "preemptions": 0,
                 "step_tokens": 0, "step_token_budget": 0, "queue_wait_ms": 0, "admitted": 0,
                 "prefix_hit_tokens": 0, "prefix_query_tokens": 0}


def _histogram(buckets: tuple[float, ...]) -> dict:
    return {"buckets": list(buckets), "counts": [0] * (len(buckets) + 1), "sum": 0.0}


def _observe(hist: dict, value: float) -> None:
    hist["counts"][bisect_left(hist["buckets"], value)] += 1
    hist["sum"] += value


class ServeMetrics:
    """One replica's counters. Not thread-safe: use it from one event loop."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted = 0  # requests that ended before finishing (client gone)
        self.replies_reused = 0  # chat assistant messages read as the ids the model generated (graphs.chat_ids)
        self.ttft = _histogram(TTFT_BUCKETS)
        self.tpot = _histogram(TPOT_BUCKETS)
        self.acceptance_length = _histogram(ACCEPT_BUCKETS)
        self.verify_steps = 0  # decode verify steps (each proposes draft tokens at every position)
        self.accepted_by_position: list[int] = []  # [k]: steps whose accept_len > k
        self.drafted_by_position: list[int] = []  # [k]: steps that drafted position k (tree depth > k)
        self.steps_by_tree_size: dict[int, int] = {}  # decode steps per tree size the engine chose
        self.draft_depth = 0
        self.gauges = dict(ENGINE_GAUGES)
        self.has_gauges = False
        self.version = 0  # bumped on every change: push only when it moved

    # ---- recording ------------------------------------------------------------------

    def record_request(self, endpoint: str, status: int | str) -> None:
        key = (endpoint, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        self.version += 1

    def record_aborted(self) -> None:
        self.aborted += 1
        self.version += 1

    def set_replies_reused(self, total: int) -> None:
        """The engine's running total (`ReplyIds.reused`)."""
        if total != self.replies_reused:
            self.replies_reused = total
            self.version += 1

    def record_first_token(self, seconds: float) -> None:
        _observe(self.ttft, seconds)
        self.version += 1

    def record_finished(self, output, ttft_s: float | None, finish_s: float | None) -> None:
        """A finished request: token counters, TPOT, acceptance length, per-position acceptance.

        `output` is an actors.request.RequestOutput."""
        self.prompt_tokens += output.num_prompt_tokens
        self.generation_tokens += output.num_output_tokens
        if ttft_s is not None and finish_s is not None and output.num_output_tokens > 1:
            _observe(self.tpot, max(0.0, finish_s - ttft_s) / (output.num_output_tokens - 1))
        if output.num_verify_steps > 0 and output.num_output_tokens > 0:
            _observe(self.acceptance_length, output.num_output_tokens / output.num_verify_steps)
        lens, depths = list(output.accept_lens), list(output.draft_depths)
        self.verify_steps += len(lens)
        self._widen(max([self.draft_depth, *lens, *depths]))
        for a in lens:
            for k in range(a):
                self.accepted_by_position[k] += 1
        for d in depths:
            for k in range(d):
                self.drafted_by_position[k] += 1
        self.version += 1

    def _widen(self, depth: int) -> None:
        for counts in (self.accepted_by_position, self.drafted_by_position):
            counts += [0] * max(0, depth - len(counts))

    def set_draft_depth(self, depth: int) -> None:
        """Draft positions per verify step (num_steps; 0 without speculation)."""
        self.draft_depth = max(self.draft_depth, depth)
        self._widen(depth)

    def set_engine_stats(self, stats: dict) -> None:
        sizes = {int(k): int(v) for k, v in stats.get("steps_by_tree_size", {}).items()}
        if sizes != self.steps_by_tree_size:  # the engine's running totals
            self.steps_by_tree_size = sizes
            self.version += 1
        new = {k: int(stats.get(k, 0)) for k in self.gauges}
        if new != self.gauges or not self.has_gauges:
            self.gauges, self.has_gauges = new, True
            self.version += 1

    # ---- snapshots ------------------------------------------------------------------

    def snapshot(self) -> dict:
        return {
            "time": time.time(),
            "requests": [[e, s, n] for (e, s), n in sorted(self.requests.items())],
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "aborted": self.aborted,
            "replies_reused": self.replies_reused,
            "ttft": copy.deepcopy(self.ttft),
            "tpot": copy.deepcopy(self.tpot),
            "acceptance_length": copy.deepcopy(self.acceptance_length),
            "verify_steps": self.verify_steps,
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
            "steps_by_tree_size": [[k, n] for k, n in sorted(self.steps_by_tree_size.items())],
            "gauges": dict(self.gauges) if self.has_gauges else None,
        }


def merge(snapshots: Iterable[dict], now: float | None = None) -> dict:
    """Add up replicas' snapshots (gauges only from those that reported within GAUGE_TTL_S)."""
    now = time.time() if now is None else now
    total = ServeMetrics().snapshot()
    total["gauges"] = None
    requests: dict[tuple[str, str], int] = {}
    for snap in snapshots:
        for e, s, n in snap["requests"]:
            requests[(e, s)] = requests.get((e, s), 0) + n
        for key in ("prompt_tokens", "generation_tokens", "aborted", "replies_reused", "verify_steps"):
            total[key] += snap.get(key, 0)
        for key in ("ttft", "tpot", "acceptance_length"):
            total[key]["counts"] = [a + b for a, b in zip(total[key]["counts"], snap[key]["counts"])]
            total[key]["sum"] += snap[key]["sum"]
        for key in ("accepted_by_position", "drafted_by_position"):
            acc = total[key]
            for k, n in enumerate(snap.get(key, [])):
                if k < len(acc):
                    acc[k] += n
                else:
                    acc.append(n)
        sizes = dict(total["steps_by_tree_size"])
        for size, n in snap.get("steps_by_tree_size", []):
            sizes[size] = sizes.get(size, 0) + n
        total["steps_by_tree_size"] = [[k, n] for k, n in sorted(sizes.items())]
        if snap.get("gauges") is not None and now - snap["time"] <= GAUGE_TTL_S:
            gauges = total["gauges"] or {}
            for k, v in snap["gauges"].items():
                gauges[k] = gauges.get(k, 0) + v
            total["gauges"] = gauges
    total["requests"] = [[e, s, n] for (e, s), n in sorted(requests.items())]
    return total


class _SnapshotCollector:
    def __init__(self, snap: dict, prefix: str):
        self.snap, self.prefix = snap, prefix

    def _hist(self, name: str, doc: str, hist: dict) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip([*hist["buckets"], float("inf")], hist["counts"]):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=hist["sum"])

    def collect(self):
        s, p = self.snap, self.prefix
        requests = CounterMetricFamily(f"{p}_requests", "HTTP requests by endpoint and status code",
                                       labels=["endpoint", "status"])
        for e, status, n in s["requests"]:
            requests.add_metric([e, status], n)
        yield requests
        yield CounterMetricFamily(f"{p}_prompt_tokens", "Prompt tokens of finished requests", value=s["prompt_tokens"])
        yield CounterMetricFamily(f"{p}_generation_tokens", "Generated tokens of finished requests",
                                  value=s["generation_tokens"])
        yield CounterMetricFamily(f"{p}_requests_aborted", "Requests abandoned by their client before finishing",
                                  value=s["aborted"])
        yield CounterMetricFamily(f"{p}_chat_replies_reused", "Assistant messages sent back unchanged and read as "
                                  "the ids the model generated, not re-tokenized", value=s["replies_reused"])
        yield self._hist(f"{p}_time_to_first_token_seconds", "Time from request arrival to its first token", s["ttft"])
        yield self._hist(f"{p}_time_per_output_token_seconds", "Decode time per output token after the first",
                         s["tpot"])
        yield self._hist(f"{p}_acceptance_length", "Output tokens per verify step, per request",
                         s["acceptance_length"])
        yield CounterMetricFamily(f"{p}_spec_verify_steps", "Speculative verify (decode) steps", value=s["verify_steps"])
        accepted = CounterMetricFamily(f"{p}_spec_accepted_tokens", "Verify steps whose draft token at a "
                                       "position was accepted (accept_len > position)", labels=["position"])
        drafted = CounterMetricFamily(f"{p}_spec_drafted_tokens", "Verify steps that drafted a token at a position "
                                      "(adaptive speculation drafts fewer, or none, where they do not pay)",
                                      labels=["position"])
        rate = GaugeMetricFamily(f"{p}_spec_acceptance_rate", "Acceptance rate of the draft token at each position, "
                                 "over the steps that drafted it", labels=["position"])
        drafted_counts = s.get("drafted_by_position", [])
        for k, n in enumerate(s["accepted_by_position"]):
            proposed = drafted_counts[k] if k < len(drafted_counts) else 0
            accepted.add_metric([str(k)], n)
            drafted.add_metric([str(k)], proposed)
            rate.add_metric([str(k)], n / proposed if proposed else 0.0)
        yield accepted
        yield drafted
        yield rate
        sizes = CounterMetricFamily(f"{p}_spec_tree_size_steps", "Decode steps by the tree size (verify nodes per "
                                    "request, root included; 1 = plain decoding) the engine chose", labels=["size"])
        for size, n in s.get("steps_by_tree_size", []):
            sizes.add_metric([str(size)], n)
        yield sizes
        g = {**ENGINE_GAUGES, **(s["gauges"] or {})}
        kv = 1.0 - g["free_slots"] / g["kv_slots"] if g["kv_slots"] else 0.0
        yield GaugeMetricFamily(f"{p}_kv_cache_usage", "Fraction of KV slots in use (0..1)", value=kv)
        yield GaugeMetricFamily(f"{p}_num_requests_waiting", "Requests queued in the scheduler", value=g["waiting"])
        yield GaugeMetricFamily(f"{p}_num_requests_running", "Requests in the running batch", value=g["running"])
        yield GaugeMetricFamily(f"{p}_prefix_cache_slots", "KV slots held by the prefix cache (evictable when "
                                "no request uses them)", value=g["cached_slots"])
        yield CounterMetricFamily(f"{p}_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=g["prefix_query_tokens"])
        yield CounterMetricFamily(f"{p}_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=g["prefix_hit_tokens"])
        hit = g["prefix_hit_tokens"] / g["prefix_query_tokens"] if g["prefix_query_tokens"] else 0.0
        yield GaugeMetricFamily(f"{p}_prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache",
                                value=hit)
        yield CounterMetricFamily(f"{p}_num_preemptions", "Requests preempted (KV freed, requeued, recomputed)",
                                  value=g["preemptions"])
        yield GaugeMetricFamily(f"{p}_step_tokens", "Tokens the last step carried (prefill chunk tokens or "
                                "verify rows)", value=g["step_tokens"])
        yield GaugeMetricFamily(f"{p}_step_token_budget", "Prefill tokens a step may carry (max_num_batched_tokens)",
                                value=g["step_token_budget"])
        yield SummaryMetricFamily(f"{p}_queue_wait_seconds", "Time from arrival to admission (first scheduled)",
                                  count_value=g["admitted"], sum_value=g["queue_wait_ms"] / 1000)


def render(snapshot: dict, prefix: str = PREFIX) -> str:
    """Prometheus text exposition of a (merged) snapshot, from its own CollectorRegistry."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot, prefix))
    return generate_latest(registry).decode()
