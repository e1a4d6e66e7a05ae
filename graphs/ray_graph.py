"""The Ray backend, driver side: placement group, scheduler actor, and the offline API
over it (generate / chat / stream, plus `astream` for asyncio callers such as HTTP)."""

from __future__ import annotations

import os
from typing import AsyncIterator, Iterator

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.request import RequestOutput
from graphs.assembly import resolve_sources
from graphs.config import EngineConfig
from graphs.engine import Engine, Messages, Prompt
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


class RayEngine(Engine):
    def __init__(self, config: EngineConfig):
        target, _ = resolve_sources(config)  # fails on a bad pair before anything starts
        super().__init__(config, load_tokenizer(target.folder))
        self._started_ray = ensure_ray()
        current = get_current_placement_group()
        if current is not None:
            # Inside a Serve replica: the graph's bundles follow the replica's own bundle.
            self._pg, self._owns_pg, offset = current, False, 1
        else:
            self._pg = placement_group(graph_bundles(config), strategy=config.placement_strategy)
            self._owns_pg, offset = True, 0
            ray.get(self._pg.ready(), timeout=300)
        self.scheduler = SchedulerActor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=offset),
            max_concurrency=1000,
        ).remote(config, self._pg, offset)
        ray.get(self.scheduler.stats.remote())  # surfaces construction errors here

    def _generate_ids(self, requests: list[tuple[list[int], SamplingParams]]) -> list[RequestOutput]:
        return ray.get([self.scheduler.generate.remote(ids, params) for ids, params in requests])

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
            ray.kill(self.scheduler, no_restart=True)
            self.scheduler = None
            if self._owns_pg:
                remove_placement_group(self._pg)
            if self._started_ray:
                ray.shutdown()
