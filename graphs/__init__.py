"""Wiring: EngineConfig, build_graph(), the per-step graph and the offline API."""
