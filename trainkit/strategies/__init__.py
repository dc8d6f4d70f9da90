"""Parallelism strategies: one file each, all implementing `base.Strategy`."""
