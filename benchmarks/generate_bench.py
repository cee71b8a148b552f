"""Tokens per second: pipelined generation against the one-device model, side by side.

GPT ``tiny`` (or ``--preset``) on 4 meshes x 2 data devices (CPU, 8 simulated
devices): ``mp.Generator`` with ``--microbatches`` sequences groups in flight,
against ``Generator.reference`` (the same step function under ``nnx.jit`` on one
device), each with the KV cache and recomputing the window, alternating,
fastest of ``--rounds``. Greedy decoding; the tokens are checked equal. Usage::

    python benchmarks/generate_bench.py [--batch 32] [--new 32] [--microbatches 4] [--rounds 3]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import time

import jax
import numpy as np
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")

    def model():
        return build_model("gpt", args.preset, num_stages=4, rngs=nnx.Rngs(0), vocab_size=64)

    window = model().config.max_len
    prompts = np.random.default_rng(0).integers(0, 64, size=(args.batch, args.prompt))
    prompts = prompts.astype(np.int32)
    runs = {}
    for cached in (True, False):
        generator = mp.Generator(
            mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=args.microbatches,
            window=window, kv_cache=cached,
        )  # fmt: skip
        label = "KV cache" if cached else "window"
        runs[f"pipelined, {label}"] = (generator.__call__, model())
        runs[f"one device, {label}"] = (generator.reference, model())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for decode, lm in runs.values():
        decode(lm, prompts, 2)  # compile
    for _ in range(args.rounds):
        outputs = []
        for name, (decode, lm) in runs.items():
            start = time.perf_counter()
            outputs.append(decode(lm, prompts, args.new))
            times[name].append(time.perf_counter() - start)
        for i in (1, 3):  # each pipelined decoding equals its one-device decoding
            np.testing.assert_array_equal(outputs[i - 1], outputs[i])
    tokens = args.batch * args.new
    rate = {name: tokens / min(ts) for name, ts in times.items()}
    print(f"GPT {args.preset}, {args.batch} sequences x {args.new} new tokens after "
          f"{args.prompt}, window {window}, 4 meshes x 2 data, m={args.microbatches}; "
          f"fastest of {args.rounds}")  # fmt: skip
    print("| decoding | tokens/s | / one device, same mode | / one device, window |")
    print("| --- | --- | --- | --- |")
    for name, value in rate.items():
        same = rate["one device, " + name.split(", ")[1]]
        print(f"| {name} | {value:.0f} | {value / same:.2f} | "
              f"{value / rate['one device, window']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
