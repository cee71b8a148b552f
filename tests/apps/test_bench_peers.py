"""`make bench-peers` compares equal work: every peer's loss matches the one-device jit.

The benchmark's peers (benchmarks/peers_*.py) are built from one plain-JAX model;
these tests run the hand-written floor and the nnx_mpmd step in-process on tiny
rows and check their losses over a few steps against the microbatched step under
one ``jax.jit`` (the denominator of every ratio), so a peer that silently does
other work (another loss scale, a missing stage, a lost update) fails here. JaxPP
runs in its own venv and is checked by the benchmark's own loss column. No
timing is asserted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import peers_bench
import peers_floor
import peers_models as pm
import peers_worker

STEPS = 2


def _one_device_losses(row: pm.Row) -> list[float]:
    step = pm.one_device_step(row)
    params = jax.device_put(pm.init_params(row), jax.devices()[0])
    xs, ys = pm.make_batch(row)
    losses = []
    for _ in range(STEPS):
        params, loss = step(params, xs, ys)
        losses.append(float(loss))
    return losses


def _peer_losses(row: pm.Row, peer: str) -> list[float]:
    run_step, block = peers_worker.step_runner(row, peer)
    return [block(run_step()) for _ in range(STEPS)]


@pytest.mark.parametrize("row_name", ["tiny", "tiny-gpt"])
def test_peer_losses_match_the_one_device_jit(row_name):
    # "tiny" has 2 meshes x 2 data x 2 virtual stages (interleaved, data parallel
    # inside stages); "tiny-gpt" is the transformer under 1F1B.
    row = pm.ROWS[row_name]
    expected = _one_device_losses(row)
    assert expected[-1] < expected[0], "the updates did not lower the loss"
    for peer in ("floor", "nnx_mpmd"):
        losses = _peer_losses(row, peer)
        np.testing.assert_allclose(losses, expected, rtol=2e-5, err_msg=f"peer {peer}")


@pytest.mark.parametrize("row_name", ["tiny", "tiny-gpt", "interleaved", "gpt"])
def test_floor_dispatch_order_runs_every_task_once_after_its_inputs(row_name):
    row = pm.ROWS[row_name]
    order = peers_floor.dispatch_order(row)
    expected = {
        (kind, s, i)
        for kind in "FB"
        for s in range(row.num_stages)
        for i in range(row.microbatches)
    }
    assert len(order) == len(expected) and set(order) == expected
    seen = set()
    for kind, s, i in order:
        if kind == "F" and s > 0:
            assert ("F", s - 1, i) in seen
        if kind == "B":
            assert ("F", s, i) in seen
            assert s == row.num_stages - 1 or ("B", s + 1, i) in seen
        seen.add((kind, s, i))


def test_bench_table_flags_a_peer_whose_loss_differs():
    def summary(loss, seconds):
        return {"median_s": seconds, "first_step_s": 10 * seconds, "first_loss": loss}

    rows = {
        "one-device": summary(2.0, 0.01),
        "nnx_mpmd": summary(2.0, 0.02),
        "floor": summary(2.5, 0.04),
    }
    peers_bench.add_ratios(rows)
    assert rows["nnx_mpmd"]["step_ratio"] == pytest.approx(2.0)
    table = peers_bench.markdown({"rows": {"tiny": rows}}, {"tiny": "a note"})
    floor_line = next(line for line in table.splitlines() if "| floor |" in line)
    assert "**differs**" in floor_line
    assert "**differs**" not in next(line for line in table.splitlines() if "| nnx_mpmd |" in line)
    assert "0.50× floor" in table
