"""Benchmarks that print JSON and draw PNG plots."""
