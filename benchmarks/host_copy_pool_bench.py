"""What one small copy between two CPU devices costs as the process has more devices.

The no-op replay of ``scaling_host_bench.py`` spends more host time per copied
array at 32 stages than at 2. This script shows where that comes from without
``nnx_mpmd``'s runtime: in fresh processes with 2, 8 and 32 CPU devices it copies
one 16-float array from device 0 to device 1 with JAX's batched copy (the call
transfers use), the same devices and the same array each time, and reports per
copy:

* the wall time (median) and the calling thread's CPU time (mean);
* the CPU time of the process's other threads: XLA's CPU client runs each copied
  buffer as a task on its worker pool, whose size is the larger of the core count
  and the device count, and whose threads spin through every queue of the pool
  while they look for more work;
* how often the calling thread was preempted (involuntary context switches), and
  how many threads the process has.

Only the device count changes between the rows, so a rise in wall time or in the
other threads' CPU is the client's, not ``nnx_mpmd``'s. ``--live N`` holds ``N``
more arrays spread over the devices while it copies, to check that the number of
live arrays is not what makes a copy dearer; ``--nice-other-threads N`` gives the
other threads the nice value ``N`` first (Linux), to see how much of the wall
time is the calling thread waiting for a core they hold.

Run::

    .venv/bin/python benchmarks/host_copy_pool_bench.py [--devices 2,8,32]
        [--copies 4000] [--live 0] [--rounds 2] [--nice-other-threads 0] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 16


def _preemptions() -> int:
    """Involuntary context switches of the calling thread (of the process off Linux)."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_nivcsw


def worker(num_devices: int, copies: int, live: int, niceness: int = 0) -> dict[str, Any]:
    """One row, in a process whose JAX backend has not started: ``copies`` copies, timed."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_num_cpu_devices", num_devices)  # before the backend starts
    sys.path.insert(0, REPO)
    from nnx_mpmd._jax_compat import batched_copy, sharding_device_list

    meshes = [jax.make_mesh((1,), ("d",), devices=[d]) for d in jax.devices()]
    shardings = [NamedSharding(mesh, P()) for mesh in meshes]
    held = [
        jax.device_put(np.full((WIDTH,), i, np.float32), shardings[i % num_devices])
        for i in range(live)
    ]
    source = [jax.device_put(np.ones((WIDTH,), np.float32), shardings[0])]
    targets = [shardings[1]]
    device_lists = [sharding_device_list(shardings[1])]
    kept: list[Any] = []  # the last copies stay alive a while, as a step's values do
    for _ in range(200):  # untimed: the pool's threads start
        kept.append(batched_copy(source, device_lists, targets))
    jax.block_until_ready(kept)
    kept.clear()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from scaling_host_bench import nice_other_threads

    nice_other_threads(niceness)
    walls, cpus = [], []
    preempted = _preemptions()
    process_start = time.process_time()
    host_start = time.thread_time()
    for _ in range(copies):
        wall, cpu = time.perf_counter(), time.thread_time()
        kept.append(batched_copy(source, device_lists, targets))
        cpus.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
        if len(kept) > 500:
            kept.pop(0)
    host_s = time.thread_time() - host_start
    process_s = time.process_time() - process_start
    preempted = _preemptions() - preempted
    jax.block_until_ready(kept)
    del held
    return {
        "devices": num_devices,
        "live_arrays": live,
        "other_threads_niceness": niceness,
        "copies": copies,
        "wall_us_median": statistics.median(walls) * 1e6,
        "host_cpu_us_mean": statistics.mean(cpus) * 1e6,
        "other_threads_cpu_us": (process_s - host_s) / copies * 1e6,
        "preempted_per_copy": preempted / copies,
        "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1,
        "load": os.getloadavg()[0],
    }


def run_row(num_devices: int, copies: int, live: int, niceness: int = 0) -> dict[str, Any]:
    """`worker` in a fresh process (the device count is fixed when JAX's backend starts)."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", str(num_devices)]
    command += ["--copies", str(copies), "--live", str(live)]
    command += ["--nice-other-threads", str(niceness)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the {num_devices}-device worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, in the order they ran."""
    header = ["devices", "live arrays", "others' nice", "wall µs/copy (median)", "host thread CPU µs/copy",
              "other threads CPU µs/copy", "host thread preempted/copy", "threads", "load"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        cells = [r["devices"], r["live_arrays"], r["other_threads_niceness"], f"{r['wall_us_median']:.1f}",
                 f"{r['host_cpu_us_mean']:.1f}", f"{r['other_threads_cpu_us']:.1f}",
                 f"{r['preempted_per_copy']:.2f}", r["threads"], f"{r['load']:.1f}"]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,8,32", help="device counts, one process each")
    parser.add_argument("--copies", type=int, default=4000, help="timed copies per row")
    parser.add_argument("--live", type=int, default=0, help="more arrays held while copying")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the device counts")
    parser.add_argument("--nice-other-threads", type=int, default=0, help="their nice value")
    parser.add_argument("--out", default=None, help="write the rows here (JSON)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        row = worker(args.worker, args.copies, args.live, args.nice_other_threads)
        print(json.dumps(row), flush=True)
        return [row]
    rows = []
    for _ in range(args.rounds):  # the device counts alternate, so a change of load hits each
        for num_devices in (int(x) for x in args.devices.split(",")):
            rows.append(run_row(num_devices, args.copies, args.live, args.nice_other_threads))
            print(json.dumps(rows[-1]), flush=True)
    print(report(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
