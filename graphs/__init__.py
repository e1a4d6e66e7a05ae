"""Wiring: EngineConfig, build_graph(), the per-step graph (the scheduler actor, its runtime and
executors), data-parallel ranks and the offline API.

May import: spec, models, actors."""

from actors.request import RequestOutput
from graphs.config import EngineConfig
from graphs.build import build_graph
from graphs.engine import Engine, LocalEngine
from spec.sampling import SamplingParams

__all__ = ["EngineConfig", "SamplingParams", "build_graph", "Engine", "LocalEngine", "RequestOutput"]
