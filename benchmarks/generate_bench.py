"""Tokens per second: pipelined generation against the one-device model, side by side.

GPT ``tiny`` (or ``--preset``) on 4 meshes x 2 data devices (CPU, 8 simulated
devices): ``mp.Generator`` with ``--microbatches`` sequences groups in flight,
against ``Generator.reference`` (the same step function under ``nnx.jit`` on one
device), alternating, fastest of ``--rounds``. Greedy decoding; the tokens are
checked equal. Usage::

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

    pipelined_model, one_device_model = model(), model()
    generator = mp.Generator(
        mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=args.microbatches,
        window=pipelined_model.config.max_len,
    )  # fmt: skip
    prompts = np.random.default_rng(0).integers(0, 64, size=(args.batch, args.prompt))
    prompts = prompts.astype(np.int32)
    generator(pipelined_model, prompts, 2)  # compile both
    generator.reference(one_device_model, prompts, 2)
    times = {"pipelined": [], "one device": []}
    for _ in range(args.rounds):
        start = time.perf_counter()
        got = generator(pipelined_model, prompts, args.new)
        times["pipelined"].append(time.perf_counter() - start)
        start = time.perf_counter()
        want = generator.reference(one_device_model, prompts, args.new)
        times["one device"].append(time.perf_counter() - start)
        np.testing.assert_array_equal(got, want)
    tokens = args.batch * args.new
    rate = {name: tokens / min(ts) for name, ts in times.items()}
    print(f"GPT {args.preset}, {args.batch} sequences x {args.new} new tokens, window "
          f"{pipelined_model.config.max_len}, 4 meshes x 2 data, m={args.microbatches}; "
          f"fastest of {args.rounds}")  # fmt: skip
    print("| decoding | tokens/s | ratio |")
    print("| --- | --- | --- |")
    for name, value in rate.items():
        print(f"| {name} | {value:.0f} | {value / rate['one device']:.2f} |")


if __name__ == "__main__":
    main()
