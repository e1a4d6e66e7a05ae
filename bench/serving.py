"""Servers the HTTP benchmarks start for themselves: a local Ray sized for every application's
actor graph, Serve on a loopback port, one application per route prefix."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable


def start_local_serve(apps: dict[str, tuple[dict, str]], port: int, spare_cpus: float = 1) -> Callable[[], None]:
    """Deploy {name: (app args, route prefix)}; returns stop() (Serve, then Ray). Logical CPUs
    cover every application's graph bundles at once plus `spare_cpus` for the replicas, never
    fewer than the machine has."""
    import ray
    from ray import serve

    from graphs.config import EngineConfig
    from graphs.runtime import graph_bundles
    from serve.app import build_app
    from serve.settings import bound_ray_gcs_env, split_args

    needed = sum(b.get("CPU", 0) for args, _ in apps.values()
                 for b in graph_bundles(EngineConfig(**split_args(args)[0], backend="ray"))) + spare_cpus
    bound_ray_gcs_env()
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(needed)), include_dashboard=False,
             log_to_driver=False)

    def stop():
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, (args, prefix) in apps.items():
            t0 = time.perf_counter()
            serve.run(build_app(args), name=name, route_prefix=prefix)
            print(f"[serve] {name}: deployed {args} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    except BaseException:
        stop()
        raise
    return stop
