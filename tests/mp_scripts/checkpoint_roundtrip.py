"""Checkpoint round trip between layouts (spawned by tests).

``--restore DIR`` restores a checkpoint into a freshly built model first;
then the script trains one step and saves to ``--save DIR``. Each process
writes ``OUT/ckpt_{process_id}.json`` with parameter sums after the restore and
the loss of the step. Runs as one process (8 CPU devices) or under
``nnx-mpmd launch --processes 2 --devices-per-process 4``; ``--layout span``
puts each of the 2 stages on devices of both processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if os.environ.get("NNX_MPMD_DUMP_AFTER_S"):  # print every stack if the script hangs
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["NNX_MPMD_DUMP_AFTER_S"]), exit=True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import nnx_mpmd as mp

info = mp.distributed.initialize()
if info.num_processes == 1:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from pipeline_models import build, make_batch, train_step_fn  # noqa: E402

from nnx_mpmd import checkpoint, schedules  # noqa: E402
from nnx_mpmd.distributed import gather, global_view  # noqa: E402


def param_sums(model, mesh) -> dict[str, float]:
    state = gather(nnx.state(model, nnx.Param), mesh)
    return {
        ".".join(map(str, path)): float(np.asarray(v.get_value(), np.float64).sum())
        for path, v in nnx.to_flat_state(state)
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--restore", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default="proc", choices=("proc", "span"))
    args = parser.parse_args()
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    if args.layout == "span":  # both stages on both processes: devices 0, 2 and 1, 3 of each
        devices = np.array(jax.devices()[:8]).reshape(4, 2).T
    mesh = mp.MpmdMesh(
        Mesh(devices, ("stage", "data"), axis_types=(AxisType.Explicit,) * 2), "stage"
    )
    model, opt, loss_fn, kind = build("lm", "adamw", 2, seed=args.seed)
    mp.place((model, opt), mesh, schedules.OneFOneB())
    tree = {"model": model, "optimizer": opt}
    result = {}
    if args.restore:
        with global_view(tree, mesh):
            checkpoint.restore(args.restore, tree)
        result["restored"] = param_sums(model, mesh)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=mesh, schedule=schedules.OneFOneB(), num_microbatches=2
    )
    result["loss"] = float(step(model, opt, make_batch(kind, 16, seed=7)))
    result["trained"] = param_sums(model, mesh)
    if args.save:
        with global_view(tree, mesh):
            checkpoint.save(args.save, tree)
    with open(os.path.join(args.out, f"ckpt_{info.process_id}.json"), "w") as f:
        json.dump(result, f)
    print("loss", result["loss"], flush=True)


if __name__ == "__main__":
    main()
