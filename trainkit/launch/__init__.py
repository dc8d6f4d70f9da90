"""Launching workers: run directory, torchrun elastic agent, failure reports."""
