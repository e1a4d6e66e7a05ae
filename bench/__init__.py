"""Benchmarks that print JSON and draw PNG plots.

May import: spec, models, actors, graphs (and the other top layer's packages: jobs, train, serve)."""
