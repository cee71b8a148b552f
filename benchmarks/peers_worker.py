"""One peer on one row, in its own process (the project's venv): prints one JSON line.

Peers here: ``one-device`` (the microbatched step under one ``jax.jit`` on one
device), ``nnx_mpmd`` (`nnx_mpmd.jit` with 1F1B, or interleaved 1F1B when the
row has 2 virtual stages) and ``floor`` (`peers_floor.FloorStep`). JaxPP runs
in `peers_jaxpp.py` under its own venv. `peers_bench.py` alternates them.

Run: ``.venv/bin/python benchmarks/peers_worker.py --row overhead --peer nnx_mpmd``
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["NNX_MPMD_COMPILE_CACHE"] = "off"  # cold first steps

import argparse
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import peers_models as pm

PEERS = ("one-device", "nnx_mpmd", "floor")


def _stage_module_class():
    from flax import nnx

    class StageParams(nnx.Module):
        """One logical stage's parameters as NNX Params; calls `peers_models.stage_forward`."""

        def __init__(self, row: pm.Row, stage: int, sp: dict) -> None:
            leaves, self.treedef = jax.tree.flatten(sp)
            self.row, self.stage = row, stage
            self.leaves = nnx.List([nnx.Param(jnp.asarray(leaf)) for leaf in leaves])

        def __call__(self, h: jax.Array) -> jax.Array:
            sp = jax.tree.unflatten(self.treedef, [leaf[...] for leaf in self.leaves])
            return pm.stage_forward(self.row, self.stage, sp, h)

    return StageParams


def nnx_mpmd_step(row: pm.Row, params: dict) -> tuple[Any, Any, Any]:
    """``(step, model, optimizer)``: the row's model as an nnx_mpmd pipelined step.

    Returns:
      ``step(model, optimizer, batch) -> loss`` and the NNX model and optimizer
      holding ``params`` (an SGD optimizer, as the other peers).
    """
    import optax
    from flax import nnx

    import nnx_mpmd as mp

    stage_params = _stage_module_class()

    class PeerModel(mp.PipelinedModel):
        def __init__(self) -> None:
            self.stages = nnx.List(
                [
                    mp.Stage(stage_params(row, s, pm.stage_params(row, params, s)), stage=s)
                    for s in range(row.num_stages)
                ]
            )

        def __call__(self, x: jax.Array) -> jax.Array:
            for stage in self.stages:
                x = stage(x)
            return x

    def loss_fn(model, batch):
        return pm.output_loss(row, model(batch["x"]), batch["y"])

    def train_step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    model = PeerModel()
    optimizer = nnx.Optimizer(model, optax.sgd(pm.LEARNING_RATE), wrt=nnx.Param)
    devices = jax.devices()[: row.devices]
    mesh = mp.MpmdMesh(
        jax.make_mesh((row.meshes, row.data), ("stage", "data"), devices=devices), "stage"
    )
    schedule = mp.Interleaved1F1B() if row.virtual > 1 else mp.OneFOneB()
    step = mp.jit(train_step, mesh=mesh, schedule=schedule, num_microbatches=row.microbatches)
    return step, model, optimizer


def full_batch(xs: np.ndarray, ys: np.ndarray) -> dict[str, jax.Array]:
    """The step's batch as nnx_mpmd takes it: microbatches stacked along rows."""
    return {
        "x": jnp.asarray(xs.reshape(-1, *xs.shape[2:])),
        "y": jnp.asarray(ys.reshape(-1, *ys.shape[2:])),
    }


def step_runner(row: pm.Row, peer: str) -> tuple[Any, Any]:
    """``(run_step, block)`` for `peers_models.time_steps`: one peer on one row."""
    params = pm.init_params(row)
    xs, ys = pm.make_batch(row)
    if peer == "one-device":
        step = pm.one_device_step(row)
        state = {"params": jax.device_put(params, jax.devices()[0])}
        xs_d, ys_d = jax.device_put((xs, ys), jax.devices()[0])

        def run_one():
            state["params"], loss = step(state["params"], xs_d, ys_d)
            return loss

        return run_one, lambda loss: float(jax.block_until_ready((loss, state))[0])
    if peer == "floor":
        from peers_floor import FloorStep

        floor = FloorStep(row, params)
        placed = floor.place_batch(xs, ys)
        return lambda: floor(*placed), lambda loss: float(
            jax.block_until_ready((loss, floor.params))[0]
        )
    if peer == "nnx_mpmd":
        step, model, optimizer = nnx_mpmd_step(row, params)
        batch = full_batch(xs, ys)
        return lambda: step(model, optimizer, batch), lambda loss: float(
            jax.block_until_ready((loss, (model, optimizer)))[0]
        )
    raise SystemExit(f"unknown peer {peer!r}; choose one of {', '.join(PEERS)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", required=True, choices=sorted(pm.ROWS))
    parser.add_argument("--peer", required=True, choices=PEERS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    pm.setup_cpu_devices(8)
    row = pm.ROWS[args.row]
    run_step, block = step_runner(row, args.peer)
    result = pm.time_steps(run_step, block, args.steps, args.warmup)
    result.update(row=args.row, peer=args.peer, jax=jax.__version__)
    print("PEERS_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
