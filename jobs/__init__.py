"""Batch generation entry points for `ray job submit`.

May import: spec, models, actors, graphs (and the other top layer's packages: bench, train, serve)."""
