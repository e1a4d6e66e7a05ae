"""One Serve application over tiny models for a test module: a local Ray, Serve on a free loopback
port outside Ray's worker range, torn down (Serve, then Ray) when the module is done."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx

from netutil import free_port
from serve.app import build_app


@contextlib.contextmanager
def tiny_server(app_args: dict, ready_timeout: float = 120) -> Iterator[str]:
    """Serves `build_app(app_args)` as the "default" app at "/"; yields its base URL once /health
    answers 200 (the caller may wait further, e.g. for a first completion)."""
    import ray
    from ray import serve

    port = free_port(8100, 9000)
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(app_args), name="default", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + ready_timeout
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def wait_idle(engine_handle, timeout: float = 60.0) -> dict:
    """The engine's stats once nothing runs or waits and every KV slot is free (or at the timeout)."""
    deadline = time.time() + timeout
    while True:
        stats = engine_handle.stats.remote().result()
        if (stats["running"] == 0 and stats["waiting"] == 0 and stats["free_slots"] == stats["kv_slots"]) \
                or time.time() > deadline:
            return stats
        time.sleep(0.1)
