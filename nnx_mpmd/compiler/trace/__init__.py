"""Tracing a step and cutting it at stages: the recorded region, the per-stage programs
(forward, backward, the BI/BW split) and their gradient reductions."""
