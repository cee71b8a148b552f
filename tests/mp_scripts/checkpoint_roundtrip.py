"""Checkpoint round trip between layouts and process counts (spawned by tests).

The model is a small LM with 4 blocks, split into ``--stages`` stages (2 or 4)
on as many submeshes: ``jax.devices()`` in process order, cut into equal
submeshes. So 2 processes x 4 devices with 2 stages puts each stage on one
process, 4 processes x 2 devices with 2 stages makes each stage span 2
processes, and 1 process x 8 devices with 4 stages has 4 submeshes of 2.

``--restore DIR`` restores a checkpoint into the placed model and optimizer
(every process passes the same placed state; no replicated view); then the
script trains one step and saves to ``--save DIR``. ``--reference DIR``
(repeatable, one process only) afterwards restores DIR into a fresh 2-stage
model on a 2 x 4 mesh and trains the same step: the one-process reference of a
multi-process step after a restore. Each process writes
``OUT/ckpt_{process_id}.json``: with ``--mismatch``, the errors of restores
into targets that do not match (tried before the real restore); per variable (model and optimizer) a CRC of
its bytes and its float64 sum, after the restore and after the step, the loss,
and the processes of every submesh.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

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
from pipeline_models import (  # noqa: E402
    OPTIMIZERS,
    SEQ,
    VOCAB,
    WIDTH,
    Block,
    Head,
    TinyLM,
    lm_loss,
    make_batch,
    train_step_fn,
)

from nnx_mpmd import checkpoint, schedules  # noqa: E402

NUM_BLOCKS = 4


class FourBlockLM(TinyLM):
    """TinyLM with 4 blocks whatever the stage count: block b is on stage b * stages // 4."""

    def __init__(self, num_stages: int, *, rngs: nnx.Rngs) -> None:
        self.embed = mp.Stage(nnx.Embed(VOCAB, WIDTH, rngs=rngs), stage=0)
        self.pos = mp.Stage(nnx.Embed(SEQ, WIDTH, rngs=rngs), stage=0)
        self.blocks = nnx.List(
            [
                mp.Stage(Block(rngs=rngs), stage=b * num_stages // NUM_BLOCKS)
                for b in range(NUM_BLOCKS)
            ]
        )
        self.head = mp.Stage(Head(None, rngs=rngs), stage=num_stages - 1)


def placed(stages: int, seed: int, devices: np.ndarray):
    mesh = mp.MpmdMesh(
        Mesh(devices.reshape(stages, -1), ("stage", "data"), axis_types=(AxisType.Explicit,) * 2),
        "stage",
    )
    model = FourBlockLM(stages, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, OPTIMIZERS["adamw"](), wrt=nnx.Param)
    mp.place((model, optimizer), mesh, schedules.OneFOneB())
    return mesh, model, optimizer


def digest(model, optimizer) -> dict[str, list]:
    """Per variable: [CRC32 of its bytes, float64 sum] (a collective)."""
    states = mp.distributed.gather({"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
    out = {}
    for name, state in states.items():
        for path, variable in nnx.to_flat_state(state):
            value = np.asarray(variable.get_value())
            key = ".".join([name, *map(str, path)])
            out[key] = [zlib.crc32(value.tobytes()), float(value.astype(np.float64).sum())]
    return out


def mismatching_restores(path: str, model, optimizer) -> list[str]:
    """Restores into targets that do not match; the errors (the same on every process)."""
    wrong_shape = jax.ShapeDtypeStruct((VOCAB + 1, WIDTH), np.float32)
    targets = [
        ({"model": model}, False),  # the optimizer is missing
        ({"model": model, "optimizer": optimizer, "extra": wrong_shape}, False),
        ({"model": {"embed": {"embedding": wrong_shape}}}, True),
    ]
    errors = []
    for target, partial in targets:
        try:
            checkpoint.restore(path, target, partial=partial)
        except mp.MpmdError as error:
            errors.append(f"{type(error).__name__}: {error}")
        else:
            errors.append("no error")
    return errors


def restore_and_train(stages, seed, devices, restore, save=None, mismatch=False) -> dict:
    mesh, model, optimizer = placed(stages, seed, devices)
    tree = {"model": model, "optimizer": optimizer}
    result: dict = {
        "submesh_processes": [
            sorted({d.process_index for d in m.devices.flat}) for m in mesh.submeshes
        ]
    }
    if restore and mismatch:
        result["mismatch"] = mismatching_restores(restore, model, optimizer)
    if restore:
        checkpoint.restore(restore, tree)
        result["restored"] = digest(model, optimizer)
    step = mp.jit(
        train_step_fn(lm_loss),
        mesh=mesh,
        schedule=schedules.OneFOneB(),
        num_microbatches=2,
        batch_axis=None,  # the embedding lookup cannot shard it over Explicit axes
    )
    result["loss"] = float(step(model, optimizer, make_batch("tokens", 16, seed=7)))
    result["trained"] = digest(model, optimizer)
    if save:
        checkpoint.save(save, tree)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--restore", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action="append", default=[])
    parser.add_argument("--mismatch", action="store_true", help="try mismatching targets first")
    args = parser.parse_args()
    devices = np.array(jax.devices()[:8])
    result = restore_and_train(
        args.stages, args.seed, devices, args.restore, args.save, args.mismatch
    )
    result["reference"] = {path: restore_and_train(2, 99, devices, path) for path in args.reference}
    with open(os.path.join(args.out, f"ckpt_{info.process_id}.json"), "w") as f:
        json.dump(result, f)
    print("loss", result["loss"], flush=True)


if __name__ == "__main__":
    main()
