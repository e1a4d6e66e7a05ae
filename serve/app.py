"""The Serve application: the engine and ingress deployments bound for a set of args."""


from dataclasses import asdict

from ray import serve

from graphs.config import EngineConfig
from graphs.runtime import graph_bundles
from serve.engine import SpecEngine
from serve.ingress import OpenAIIngress
from serve.settings import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, split_args


def build_app(args: dict | None = None) -> serve.Application:
    """The Serve application for `args` (EngineConfig fields and ServeSettings fields)."""
    engine_kwargs, settings = split_args(args)
    config = EngineConfig(**engine_kwargs, backend="ray")
    batch = config.max_running_requests * config.dp_size
    max_ongoing = settings.max_ongoing_requests or batch + settings.max_queue + 16
    target = settings.target_ongoing_requests or max(1.0, 0.75 * batch)
    engine = serve.deployment(SpecEngine, name=ENGINE_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": settings.replica_num_cpus},
        placement_group_bundles=[{"CPU": settings.replica_num_cpus}] + graph_bundles(config),
        placement_group_strategy=config.placement_strategy,
        autoscaling_config={"min_replicas": settings.min_replicas, "initial_replicas": max(1, settings.min_replicas),
                            "max_replicas": settings.max_replicas, "target_ongoing_requests": target},
        max_ongoing_requests=max_ongoing,
        max_queued_requests=max(1, settings.max_queue),
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=30,
    )
    ingress = serve.deployment(OpenAIIngress, name=INGRESS_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": 0.1},
        num_replicas=settings.ingress_replicas,
        max_ongoing_requests=max_ongoing * settings.max_replicas + 64,
    )
    settings_dict = asdict(settings)
    return ingress.bind(engine.bind(engine_kwargs, settings_dict), engine_kwargs, settings_dict)


