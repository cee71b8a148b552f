"""The README's example runs and trains (so the front page cannot rot)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs_and_trains():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    program = blocks[0] + (
        "\nimport numpy as np\n"
        "rng = np.random.default_rng(0)\n"
        "batch = {k: rng.normal(size=(32, 16)).astype(np.float32) for k in ('x', 'y')}\n"
        "losses = [float(train_step(model, optimizer, batch)) for _ in range(3)]\n"
        "assert losses[2] < losses[0], losses\n"
        "print('ok', losses)\n"
    )
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok" in result.stdout
