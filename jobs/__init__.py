"""Batch generation entry points for `ray job submit`."""
