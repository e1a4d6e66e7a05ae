"""The metrics hub: one small actor per application, fed by every replica, read by `/metrics`."""

import asyncio
import logging
import uuid

import ray
from ray import serve

from graphs.metrics import ServeMetrics
from serve.settings import METRICS_PUSH_S

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class MetricsHub:
    def __init__(self):
        self.snapshots: dict[str, dict] = {}

    def report(self, key: str, snapshot: dict) -> None:
        self.snapshots[key] = snapshot

    def retire(self, key: str) -> None:
        """A replica stopped: keep its counters, drop its gauges."""
        if key in self.snapshots:
            self.snapshots[key]["gauges"] = None

    def collect(self) -> dict[str, dict]:
        return self.snapshots


class MetricsReporter:
    """Pushes a replica's ServeMetrics snapshot to the application's hub when it changed."""

    def __init__(self, metrics: ServeMetrics, key: str, app_name: str, refresh=None):
        self.metrics, self.key, self.hub_name = metrics, key, f"specgraph-metrics:{app_name}"
        self.refresh = refresh  # async callable run before each push (e.g. engine gauges)
        self.hub = None
        self._pushed = -1
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def get_hub(self):
        if self.hub is None:
            self.hub = MetricsHub.options(name=self.hub_name, get_if_exists=True,
                                          scheduling_strategy="DEFAULT").remote()
        return self.hub

    async def collect(self, fresh: dict | None = None) -> list[dict]:
        """All replicas' snapshots: this one's taken now, and `fresh` ({key: snapshot}) over the hub's."""
        try:
            hub = await asyncio.to_thread(self.get_hub)
            snaps = dict(await hub.collect.remote())
        except Exception:  # noqa: BLE001 - the hub went away with its owner: rebuilt on next use
            log.warning("metrics hub unavailable", exc_info=True)
            self.hub, snaps = None, {}
        snaps.update(fresh or {})
        snaps[self.key] = self.metrics.snapshot()
        return list(snaps.values())

    async def push(self) -> None:
        if self.refresh is not None:
            await self.refresh()
        if self.metrics.version == self._pushed:
            return
        version = self.metrics.version
        try:
            hub = await asyncio.to_thread(self.get_hub)
            await hub.report.remote(self.key, self.metrics.snapshot())
            self._pushed = version
        except Exception:  # noqa: BLE001
            log.debug("metrics push failed", exc_info=True)
            self.hub = None

    async def _run(self) -> None:
        while True:
            try:
                await self.push()
            except Exception:  # noqa: BLE001 - metrics never take the replica down
                log.debug("metrics refresh failed", exc_info=True)
            await asyncio.sleep(METRICS_PUSH_S)

    def retire(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.hub is not None:
            try:
                self.hub.report.remote(self.key, self.metrics.snapshot())
                self.hub.retire.remote(self.key)
            except Exception:  # noqa: BLE001
                pass


def replica_key() -> tuple[str, str]:
    try:
        ctx = serve.get_replica_context()
        return f"{ctx.deployment}#{ctx.replica_id.unique_id}", ctx.app_name
    except Exception:  # noqa: BLE001 - outside Serve (tests)
        return f"local#{uuid.uuid4().hex[:8]}", "default"


