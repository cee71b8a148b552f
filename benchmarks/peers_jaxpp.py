"""JaxPP on one row of `make bench-peers`, in JaxPP's own venv: prints one JSON line.

JaxPP (NVIDIA, Apache-2.0) pins jax 0.9.2, so it cannot share the project's
venv; `bash ../shared/peers/setup_jaxpp.sh .peers/jaxpp-venv` builds one (CPU,
one process, transfers by ``jax.device_put``). This worker imports only JAX,
NumPy, JaxPP and `peers_models`, and runs the same model, batch and SGD update as
the other peers: ``jaxpp.treduce`` over the microbatches with a stage boundary
(``mark_stage_end``) after each logical stage, under ``mpmd_jit_with_loop``.
Its first step counts ``compile()`` and the first call.

Run: ``.peers/jaxpp-venv/bin/python benchmarks/peers_jaxpp.py --row overhead``
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools
import json

import jax
import numpy as np
import peers_models as pm
from jax.sharding import PartitionSpec as P


def microbatch_loss_marked(jaxpp, row: pm.Row, params: dict, batch) -> jax.Array:
    """`peers_models.microbatch_loss` / m with JaxPP's stage boundaries marked."""
    x, y = batch
    h = x
    for s in range(row.num_stages):
        h = pm.stage_forward(row, s, pm.stage_params(row, params, s), h)
        h = jaxpp.mark_stage_end(h)  # JaxPP wants one per stage, the last one too
    return pm.output_loss(row, h, y) / row.microbatches


def jaxpp_step(row: pm.Row):
    """``(compiled_fn_factory, mesh)``: the row's train step under ``mpmd_jit_with_loop``."""
    import jaxpp.api as jaxpp

    if row.virtual > 1:
        schedule = jaxpp.Interleaved1F1B(num_stages=row.num_stages, mpmd_dim=row.meshes)
    else:
        schedule = jaxpp.Std1F1B(row.meshes)

    def train_step(params, xs, ys):
        loss, grads = jaxpp.treduce(
            functools.partial(
                jax.value_and_grad(functools.partial(microbatch_loss_marked, jaxpp, row)), params
            ),
            (xs, ys),
            schedule=schedule,
            operation=jaxpp.Add,
        )
        return pm.sgd(params, grads), loss

    devices = np.asarray(jax.devices()[: row.devices]).reshape(row.meshes, row.data)
    mesh = jax.sharding.Mesh(devices, ("stage", "data"))
    mpmd_mesh = jaxpp.MpmdMesh(mesh, "stage")
    params = pm.init_params(row)
    param_specs = jax.tree.map(lambda _: P(), params)
    fn = jaxpp.mpmd_jit_with_loop(
        train_step,
        mpmd_mesh=mpmd_mesh,
        in_specs=(param_specs, P(None, "data"), P(None, "data")),
        out_specs=(param_specs, P()),
    )
    return fn, mesh, params


def to_float(x) -> float:
    return float(np.asarray(x.to_mpmd_local_array if hasattr(x, "to_mpmd_local_array") else x))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", required=True, choices=sorted(pm.ROWS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    pm.setup_cpu_devices(8)
    row = pm.ROWS[args.row]
    fn, mesh, params = jaxpp_step(row)
    xs, ys = pm.make_batch(row)
    state: dict = {"params": params, "compiled": None}

    def run_step():
        if state["compiled"] is None:
            state["compiled"] = fn.compile(state["params"], xs, ys)
        state["params"], loss = state["compiled"](state["params"], xs, ys)
        return loss

    def block(loss) -> float:
        jax.block_until_ready((loss, state["params"]))
        return to_float(loss)

    with mesh:
        result = pm.time_steps(run_step, block, args.steps, args.warmup)
    result.update(row=args.row, peer="jaxpp", jax=jax.__version__)
    print("PEERS_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
