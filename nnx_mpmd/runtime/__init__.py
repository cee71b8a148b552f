"""Runtimes that execute compiled per-mesh instruction lists."""
