"""Measured live activation memory per mesh follows the schedule simulator.

Tolerance: on mesh r the bytes held above the mesh's baseline (just before its
first task) are the simulator's peak microbatches in flight times one
microbatch's activation bytes, plus at most two boundary-sized buffers in flight
(a cotangent being received and the next forward's prefetched input), minus at
most one. A microbatch's activation bytes are measured under GPipe, which holds
every microbatch (checked: doubling m doubles its memory).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import make_mesh

import nnx_mpmd as mp

WIDTH, ROWS, MESHES = 16, 128, 4
BOUNDARY_BYTES = ROWS * WIDTH * 4  # one microbatch of activations between stages


class Deep(mp.PipelinedModel):
    def __init__(self, remat, *, rngs):
        self.layers = nnx.List(
            [
                mp.Stage(
                    nnx.Sequential(*[nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(3)]),
                    stage=s,
                    remat=remat,
                )
                for s in range(MESHES)
            ]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _step(model, opt, batch):
    loss, grads = mp.value_and_grad(_loss)(model, batch)
    opt.update(model, grads)
    return loss


def held_above_baseline(schedule, remat, m):
    """Per mesh: peak live bytes during its tasks minus the bytes just before."""
    model = Deep(remat, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    batch = {k: rng.normal(size=(m * ROWS, WIDTH)).astype(np.float32) for k in ("x", "y")}
    f = mp.jit(_step, mesh=make_mesh(MESHES, 1), schedule=schedule, num_microbatches=m)
    f(model, opt, batch, memory=True)
    timeline = f.last_memory["timeline"]
    held = []
    for r in range(MESHES):
        first = next(
            i for i, (_, label, _) in enumerate(timeline) if label.startswith((f"F{r}.", f"FB{r}."))
        )
        baseline = timeline[first - 1][2][r]
        held.append(max(b[r] for _, _, b in timeline[first:]) - baseline)
    return held


@pytest.fixture(scope="module")
def measured():
    out = {}
    for remat in (False, True):
        out[remat, "gpipe", 8] = held_above_baseline(mp.GPipe(), remat, 8)
        out[remat, "gpipe", 4] = held_above_baseline(mp.GPipe(), remat, 4)
        out[remat, "1f1b", 8] = held_above_baseline(mp.OneFOneB(), remat, 8)
    return out


def _predicted(schedule, m):
    tasks = schedule.tasks(MESHES, MESHES, m)
    return mp.schedules.simulate(tasks).peak_activations


def per_microbatch(measured, remat, r):
    """Activation bytes per microbatch on mesh r: GPipe's memory slope in m."""
    return (measured[remat, "gpipe", 8][r] - measured[remat, "gpipe", 4][r]) / 4


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_gpipe_holds_every_microbatch(measured, remat):
    assert _predicted(mp.GPipe(), 8) == (8,) * MESHES
    for r in range(MESHES):
        slope = per_microbatch(measured, remat, r)
        intercept = measured[remat, "gpipe", 8][r] - 8 * slope
        assert slope >= BOUNDARY_BYTES / 2, (r, slope)  # it grows with every microbatch
        assert 0 <= intercept <= 2 * BOUNDARY_BYTES, (r, intercept)


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_one_f_one_b_holds_p_minus_r_microbatches(measured, remat):
    predicted = _predicted(mp.OneFOneB(), 8)
    assert predicted == tuple(MESHES - r for r in range(MESHES))
    for r in range(MESHES):
        activations = per_microbatch(measured, remat, r)
        held = measured[remat, "1f1b", 8][r]
        if r == MESHES - 1:  # the last stage fuses F and B: nothing waits between them
            assert held <= activations + 2 * BOUNDARY_BYTES
            continue
        low = predicted[r] * activations - BOUNDARY_BYTES
        high = predicted[r] * activations + 2 * BOUNDARY_BYTES
        assert low <= held <= high, (r, held / activations, predicted[r])


def test_remat_lowers_the_peak(measured):
    for schedule in ("gpipe", "1f1b"):
        plain, remat = measured[False, schedule, 8], measured[True, schedule, 8]
        assert all(b < a for a, b in zip(plain[:-1], remat[:-1])), (schedule, plain, remat)
    # With remat a forward keeps about its stage input: close to one boundary buffer.
    kept = [per_microbatch(measured, True, r) for r in range(MESHES - 1)]
    assert all(k <= 1.5 * BOUNDARY_BYTES for k in kept), kept
