"""The README's example runs and trains (so the front page cannot rot).

It runs in this process (8 CPU devices, set by conftest.py) with the docs pages'
snippet runner, in a fresh namespace: no interpreter and JAX start-up of its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_docs import extract_python_blocks, run_blocks

ROOT = Path(__file__).resolve().parents[2]


def test_readme_example_runs_and_trains():
    blocks = extract_python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert blocks, "README.md has no python example"
    example = run_blocks("README.md", blocks[:1], folder=ROOT)
    rng = np.random.default_rng(0)
    batch = {k: rng.normal(size=(32, 16)).astype(np.float32) for k in ("x", "y")}
    train_step, model, optimizer = example["train_step"], example["model"], example["optimizer"]
    losses = [float(train_step(model, optimizer, batch)) for _ in range(3)]
    assert losses[2] < losses[0], losses
