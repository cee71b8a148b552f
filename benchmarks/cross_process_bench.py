"""Cross-process transfers and a spanning pipeline step, against the same in one process.

Run under ``nnx-mpmd launch --processes 2 --devices-per-process 4 -- python
benchmarks/cross_process_bench.py --out DIR`` and as one process
(``python benchmarks/cross_process_bench.py --out DIR``, 8 CPU devices):

* transfers (two processes only): ``jax.device_put`` of an array between two
  2-device submeshes, there and back ``--reps`` times (each move waits for the
  previous one): between two submeshes of process 0 (in-process) and between a
  submesh of process 0 and one of process 1 (cross-process). Reports the
  one-way time and throughput per size.
* step: the 4 x 2 layout whose every stage spans both processes
  (tests/mp_scripts/train.py, ``span``), a small MLP, 1F1B with 4 microbatches;
  the median step time over ``--steps`` steps after 2 warm-up steps.

Process 0 writes ``DIR/bench_<processes>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import nnx_mpmd as mp

info = mp.distributed.initialize()
if info.num_processes == 1:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from pipeline_models import build, make_batch, train_step_fn  # noqa: E402

from nnx_mpmd import schedules  # noqa: E402
from nnx_mpmd.runtime.coordination import get_coordination  # noqa: E402
from nnx_mpmd.runtime.cross_process import put_between_meshes, put_from_host  # noqa: E402

SIZES = (16, 64 << 10, 16 << 20)


def _ready(x: jax.Array) -> None:
    for shard in x.addressable_shards:
        shard.data.block_until_ready()


def transfer_times(reps: int) -> dict[str, dict[str, float]]:
    """One-way seconds per move, in-process and cross-process, per size in bytes."""
    local = [d for d in jax.devices() if d.process_index == 0]
    remote = [d for d in jax.devices() if d.process_index == 1]
    meshes = {
        "in-process": (Mesh(np.array(local[:2]), ("d",)), Mesh(np.array(local[2:4]), ("d",))),
        "cross-process": (Mesh(np.array(local[:2]), ("d",)), Mesh(np.array(remote[:2]), ("d",))),
    }
    results: dict[str, dict[str, float]] = {}
    for kind, (a, b) in meshes.items():
        to_a, to_b = NamedSharding(a, P("d")), NamedSharding(b, P("d"))
        for nbytes in SIZES:
            x = put_from_host(np.ones((2, max(nbytes // 8, 1)), np.float32), to_a)
            for _ in range(2):  # warm-up: connections, executables
                x = put_between_meshes(put_between_meshes(x, to_b), to_a)
            _ready(x)
            count = reps if nbytes < (1 << 20) else max(reps // 10, 3)
            start = time.perf_counter()
            for _ in range(count):
                x = put_between_meshes(put_between_meshes(x, to_b), to_a)
            _ready(x)
            results.setdefault(kind, {})[str(nbytes)] = (time.perf_counter() - start) / (2 * count)
    return results


def step_time(steps: int) -> float:
    devices = np.array(jax.devices()[:8]).reshape(-1, 4).T  # stage i: device i of each process
    mesh = mp.MpmdMesh(
        Mesh(devices, ("stage", "data"), axis_types=(AxisType.Explicit,) * 2), "stage"
    )
    model, opt, loss_fn, kind = build("mlp", "adamw", 4)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=mesh, schedule=schedules.OneFOneB(), num_microbatches=4
    )
    times = []
    for i in range(steps + 2):
        batch = make_batch(kind, 16, seed=i)
        start = time.perf_counter()
        float(step(model, opt, batch))
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    result: dict[str, object] = {"processes": info.num_processes}
    if info.num_processes == 2:
        result["transfers"] = transfer_times(args.reps)
        # Line the processes up again: the step's compilation places constants with a
        # collective that gives up after 30 s (see the multi-process guide, "Limits").
        get_coordination().barrier("bench/step", "starting the step benchmark")
    result["step_s"] = step_time(args.steps)
    if info.is_main:
        with open(os.path.join(args.out, f"bench_{info.num_processes}.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
