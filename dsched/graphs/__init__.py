"""Embedded workload graphs (the default main job)."""
