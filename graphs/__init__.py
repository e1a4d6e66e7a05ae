"""Wiring: EngineConfig, build_graph(), the per-step graph and the offline API."""

from actors.request import RequestOutput
from graphs.config import EngineConfig
from graphs.engine import Engine, LocalEngine, build_graph
from spec.sampling import SamplingParams

__all__ = ["EngineConfig", "SamplingParams", "build_graph", "Engine", "LocalEngine", "RequestOutput"]
