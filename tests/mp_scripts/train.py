"""Trains the test models with several schedules and writes the losses (spawned by tests).

Runs the same way as one process (8 CPU devices) or under ``nnx-mpmd launch``
with 8 devices in all (``--processes 2 --devices-per-process 4`` or
``--processes 4 --devices-per-process 2``). A run is
``schedule:meshes:stages[:layout[:model[:donate]]]`` (layout: how stages sit on the
devices, see `mesh_devices`; model: one of pipeline_models.MODELS; ``donate``: the
step donates the model's and optimizer's state, ``mp.jit(donate_argnums=(0, 1))``). Every process writes
``OUT/losses_{process_id}.json`` with the losses and a parameter checksum per run
(after ``mp.distributed.gather``), how many parameters were remote before the
gather, the seconds of the first step, and (process 0) the address the
coordination service listens on.

``NNX_MPMD_TEST_KILL_AT_STEP=i`` SIGKILLs one process at the start of step i:
the last one, or ``NNX_MPMD_TEST_KILL_PROCESS`` (0 is the coordinator).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

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

from nnx_mpmd import schedules  # noqa: E402

SCHEDULES = {"1f1b": schedules.OneFOneB, "interleaved": schedules.Interleaved1F1B}


def mesh_devices(meshes: int, layout: str) -> np.ndarray:
    """The (stage, data) device grid over 8 devices (process p holds the p-th run of them).

    With 2 processes x 4 devices: ``proc``: devices in process order, so each stage
    is on one process (2 stages) or a process holds two stages (4); ``span``: stage
    i gets device i of every process, so every stage spans both processes; ``mixed``
    (4 stages of 2): stages on processes {0}, {0, 1}, {1}, {0, 1}, so transfers go
    between equal, overlapping and disjoint process sets. With 4 processes x 2
    devices: ``proc`` with 2 stages puts each stage on two processes ({0, 1} and
    {2, 3}, the batch split over 4 devices); ``pairs`` (4 stages of 2): stage 0 on
    devices 0 and 2, stage 1 on 1 and 3 (processes {0, 1} both), stages 2 and 3
    likewise on processes {2, 3}, so every process holds a device of two stages
    and transfers go between equal and disjoint process sets; ``shift`` (4 stages
    of 2) moves every stage one device on, so stage i sits on processes
    {i, i + 1 mod 4} (a ring of stages over the processes: a process receives
    one shard of a transfer and sends the other).
    """
    devices = np.array(jax.devices()[:8])
    if layout == "span":
        return devices.reshape(-1, meshes).T  # column p: process p's devices
    if layout == "mixed":
        return devices[[0, 1, 2, 4, 5, 6, 7, 3]].reshape(4, 2)
    if layout == "shift":
        return np.roll(devices, -1).reshape(meshes, -1)
    if layout == "pairs":
        return devices[[0, 2, 1, 3, 4, 6, 5, 7]].reshape(4, 2)
    return devices.reshape(meshes, -1)


def run(name, meshes, stages, steps, model_name, opt_name, layout="proc", donate=False):
    devices = mesh_devices(meshes, layout)
    data = devices.shape[1]
    mesh = mp.MpmdMesh(
        Mesh(devices, ("stage", "data"), axis_types=(AxisType.Explicit,) * 2), "stage"
    )
    model, opt, loss_fn, kind = build(model_name, opt_name, stages)
    microbatches = 4
    threads = os.environ.get("NNX_MPMD_TEST_COMPILE_THREADS")  # 1: no precompile
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=mesh,
        schedule=SCHEDULES[name](),
        num_microbatches=microbatches,
        compile_threads=int(threads) if threads else None,
        donate_argnums=(0, 1) if donate else (),
    )
    losses = []
    kill_at = int(os.environ.get("NNX_MPMD_TEST_KILL_AT_STEP", "-1"))
    victim = int(os.environ.get("NNX_MPMD_TEST_KILL_PROCESS", str(info.num_processes - 1)))
    first_step_s = 0.0
    for i in range(steps):
        batch = make_batch(kind, microbatches * 2 * data, seed=i)
        if i == kill_at and info.process_id == victim:
            # Die at the start of this step: the others are left waiting for this process's
            # part of it. (A timer firing "mid-step" raced with tiny, fast steps: all of them
            # could finish before it fired.)
            print(f"killing process {victim} at step {i}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.perf_counter()
        # The last step is profiled: every process records every schedule task.
        losses.append(float(step(model, opt, batch, profile=i == steps - 1)))
        if i == 0:
            first_step_s = time.perf_counter() - start
    values = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    remote_before = sum(mp.distributed.is_remote(x) for x in values)
    mp.distributed.gather(model)  # a collective; no mesh needed
    values = [v.get_value() for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    local = jax.local_devices()[0]
    all_local = all(isinstance(x, jax.Array) and x.devices() == {local} for x in values)
    params = {
        ".".join(map(str, path)): float(np.asarray(v.get_value(), np.float64).sum())
        for path, v in nnx.iter_graph(model)
        if isinstance(v, nnx.Param)
    }
    return {
        "losses": losses,
        "param_sums": params,
        "remote_before_gather": remote_before,
        "local_after_gather": all_local,
        "mp_gather": try_mp_gather(opt),
        "first_step_s": first_step_s,
        "profiled_tasks": sorted(str(t) for _, _, t, _, _ in step.last_profile if t is not None),
    }


def try_mp_gather(opt) -> str:
    """What ``mp.gather`` does with the (still placed) optimizer state: "ok" or the error."""
    try:
        mp.gather(opt)
    except Exception as error:  # reported to the test, which says what went wrong
        return f"{type(error).__name__}: {error}"[:400]
    local = jax.local_devices()[0]
    values = [v.get_value() for _, v in nnx.iter_graph(opt) if isinstance(v, nnx.Variable)]
    arrays = [x for x in values if isinstance(x, jax.Array)]
    return "ok" if all(x.devices() == {local} for x in arrays) else "not local"


def coordinator_listen_addresses() -> list[str]:
    """``/proc/net/tcp*`` entries listening on the coordinator's port (process 0 hosts it)."""
    coordinator = info.coordinator or ""
    if not coordinator or not os.path.exists("/proc/net/tcp"):
        return []
    port = f"{int(coordinator.rsplit(':', 1)[1]):04X}"
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, state = fields[1], fields[3]
                if state == "0A" and address.endswith(f":{port}"):  # 0A: LISTEN
                    found.append(address)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", default="1f1b:2:2,interleaved:2:4")
    parser.add_argument("--model", default="lm")
    parser.add_argument("--opt", default="clip_adamw_cosine")
    args = parser.parse_args()
    results = {}
    for spec in args.runs.split(","):
        name, meshes, stages, *rest = spec.split(":")
        layout = rest[0] if rest else "proc"
        model = rest[1] if len(rest) > 1 else args.model
        donate = len(rest) > 2 and rest[2] == "donate"
        results[spec] = run(
            name, int(meshes), int(stages), args.steps, model, args.opt, layout, donate
        )
        print(f"{spec}: {results[spec]['losses']}", flush=True)
    if info.is_main:
        results["coordinator_listens_on"] = coordinator_listen_addresses()
    path = os.path.join(args.out, f"losses_{info.process_id}.json")
    with open(path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    try:
        main()
    except mp.DistributedError as error:
        print(f"DistributedError: {error}", flush=True)
        os._exit(3)
