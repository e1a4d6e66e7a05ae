"""The Ray backend, driver side: placement group, scheduler actor, and the offline API
over it (generate / chat / stream, plus `astream` for asyncio callers such as HTTP)."""

from __future__ import annotations

import json
import os
import time
from typing import AsyncIterator, Iterator

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.request import RequestOutput
from graphs.assembly import resolve_sources
from graphs.config import EngineConfig
from graphs.engine import Engine, Messages, Prompt, refused_output
from graphs.runtime import graph_bundles
from graphs.scheduler_actor import SchedulerActor
from models.build import load_tokenizer
from spec.sampling import SamplingParams


def ensure_ray() -> bool:
    """Connect to the cluster in RAY_ADDRESS or the one `ray.init` already joined, else start
    a local one. Returns True when this call started Ray (and so should stop it)."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    ray.init(address="local")  # never attach to some other cluster on this machine by accident
    return True


PLACEMENT_TIMEOUT_S = 300.0  # how long a placement group may wait for an autoscaler to add nodes


def resource_shortfall(bundles: list[dict], strategy: str, nodes: list[dict]) -> list[str]:
    """What the cluster's nodes (each node's total resources) can never give `bundles`:
    one line per missing resource or unplaceable bundle, empty when it all fits."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    has = {name: sum(node.get(name, 0.0) for node in nodes) for name in total}
    missing = [f"{name}: needs {need:g}, the cluster has {has[name]:g}" for name, need in sorted(total.items())
               if need > has[name] + 1e-9]
    fits = lambda want, node: all(node.get(k, 0.0) + 1e-9 >= v for k, v in want.items())  # noqa: E731
    if not missing:
        for i, bundle in enumerate(bundles):
            if not any(fits(bundle, node) for node in nodes):
                missing.append(f"bundle {i} {bundle} fits on no single node")
        if strategy == "STRICT_PACK" and not any(fits(total, node) for node in nodes):
            missing.append(f"STRICT_PACK needs {total} on one node")
    return missing


def _autoscaling() -> bool:
    """Whether an autoscaler could add the nodes a placement group waits for."""
    try:
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.autoscaler.v2.utils import is_autoscaler_v2
        from ray.experimental.internal_kv import _internal_kv_get

        if is_autoscaler_v2():
            return True
        raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
        if not raw:
            return False
        active = (json.loads(raw).get("autoscaler_report") or {}).get("active_nodes") or {}
        # Without an autoscaling config Ray's monitor runs a read-only provider that names each
        # node's type after the node (ray.autoscaler._private.util.format_readonly_node_type).
        return not all(node_type.startswith("node_") for node_type in active)
    except Exception:  # noqa: BLE001 - unknown: assume none, fail fast
        return False


def wait_placed(pg, config: EngineConfig, bundles: list[dict]) -> None:
    """Wait for the placement group; raise at once (ValueError naming what is missing and
    what the cluster has) when it can never be placed and no autoscaler could add nodes."""
    ready = pg.ready()
    deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
    while not ray.wait([ready], timeout=1.0)[0]:
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        short = resource_shortfall(bundles, config.placement_strategy, nodes)
        what = (f"the engine's placement group (dp_size={config.dp_size}; per rank a target bundle, then a draft "
                f"bundle unless the draft is colocated: {bundles}) cannot be placed: " + "; ".join(short))
        if short and not _autoscaling():
            raise ValueError(f"{what}. Lower target_num_cpus/draft_num_cpus/GPUs or dp_size, or add nodes.")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what if short else 'the engine placement group is still pending'} "
                               f"after {PLACEMENT_TIMEOUT_S:.0f} s")


class RayEngine(Engine):
    def __init__(self, config: EngineConfig):
        target, _ = resolve_sources(config)  # fails on a bad pair before anything starts
        super().__init__(config, load_tokenizer(target.folder))
        self._started_ray = ensure_ray()
        self._pg, self._owns_pg, self.scheduler = None, False, None
        try:
            current = get_current_placement_group()
            if current is not None:
                # Inside a Serve replica: the graph's bundles follow the replica's own bundle.
                self._pg, offset = current, 1
            else:
                bundles = graph_bundles(config)
                self._pg = placement_group(bundles, strategy=config.placement_strategy)
                self._owns_pg, offset = True, 0
                wait_placed(self._pg, config, bundles)
            self.scheduler = SchedulerActor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=offset),
                max_concurrency=1000,
                # One torch thread: the scheduler's tensor ops are small, and an OpenMP team of its
                # own spins after each one on the cores the runners compute on (make serve's bf16 tree
                # steps ran 0.79x the local engine's with it, 0.96x without; docs/benchmarks.md).
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
            ).remote(config, self._pg, offset)
            ray.get(self.scheduler.stats.remote())  # surfaces construction errors here
        except BaseException:
            self._release()  # no placement group (asking the autoscaler for nodes) outlives a failed start
            raise

    def _generate_ids(self, requests: list[tuple[list[int], SamplingParams]],
                      errors_as_outputs: bool = False) -> list[RequestOutput]:
        # One call: the scheduler queues the whole batch before its next step, as the local engine does.
        outs = ray.get(self.scheduler.generate_many.remote(requests, errors_as_outputs))
        return [refused_output(ids, out) if isinstance(out, ValueError) else out
                for (ids, _), out in zip(requests, outs)]

    def _stream_ids(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        for event in self.stream_events(prompt_ids, params):
            if event["delta"]:
                yield event["delta"]

    def stream_events(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[dict]:
        """Raw progress events: {"delta", "finished", "output"} (output set when finished)."""
        generator = self.scheduler.stream.options(num_returns="streaming").remote(prompt_ids, params)
        try:
            for ref in generator:
                yield ray.get(ref)
        finally:
            ray.cancel(generator)

    async def astream_events(self, prompt: Prompt | Messages | list[int], params: SamplingParams) -> AsyncIterator[dict]:
        """asyncio variant of stream_events; closing it aborts the request."""
        prompt_ids = self.encode(prompt)
        generator = self.scheduler.stream.options(num_returns="streaming").remote(prompt_ids, params)
        try:
            async for ref in generator:
                yield await ref
        finally:
            ray.cancel(generator)

    async def astream(self, prompt: Prompt | Messages, params: SamplingParams | None = None) -> AsyncIterator[str]:
        async for event in self.astream_events(prompt, params or SamplingParams()):
            if event["delta"]:
                yield event["delta"]

    def stats(self) -> dict:
        return ray.get(self.scheduler.stats.remote())

    def actors(self) -> list:
        return ray.get(self.scheduler.actors.remote())

    def shutdown(self) -> None:
        if self.scheduler is None:
            return
        try:
            ray.get(self.scheduler.shutdown.remote(), timeout=60)
        finally:
            self._release()

    def _release(self) -> None:
        """Kill the scheduler actor, remove our placement group, stop the Ray we started."""
        try:
            if self.scheduler is not None:
                ray.kill(self.scheduler, no_restart=True)
        finally:
            self.scheduler = None
            try:
                if self._owns_pg and self._pg is not None:
                    remove_placement_group(self._pg)
                    self._pg = None
            finally:
                if self._started_ray:
                    ray.shutdown()
                    self._started_ray = False
