"""bf16 compute against float32 compute: step time of the same pipelined train step.

Two copies of one zoo model (same preset, same initial parameters) and the same
`mp.jit` step (1F1B on ``--num-meshes`` x ``--data`` devices, m = ``--microbatches``,
AdamW); one runs under ``mp.Precision(compute_dtype=jnp.bfloat16)`` (float32
master parameters and optimizer state, float32 loss), the other in float32. The
two steps are timed in alternating rounds in one process, so drifts of the
machine hit both alike; the row reports the median step time of each (every step
waited for), the ratio bf16 / float32, and the losses after the timed steps
(close, not equal: the bf16 run rounds). Runs on the default backend:
``JAX_PLATFORMS=cuda`` for a GPU (``--num-meshes 1 --data 1`` on one device), 8
simulated CPU devices otherwise. On CPU, bf16 is usually slower: XLA:CPU has
few native bf16 kernels and converts around them. Usage::

    python benchmarks/precision_bench.py [--model gpt] [--preset small] [--seq 256]
        [--batch 32] [--microbatches 4] [--num-meshes 2] [--data 1] [--rounds 5]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.models import build_model, lm_loss

STEPS_PER_ROUND = 5


def _step_for(precision: mp.Precision) -> Callable[..., Any]:
    loss_fn = precision.wrap(lm_loss)

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> Any:
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def _variant(args: argparse.Namespace, precision: mp.Precision, mesh: mp.MpmdMesh) -> Any:
    """The step bound to its own model and optimizer, as ``batch -> loss``."""
    model = build_model(
        args.model,
        args.preset,
        num_stages=args.num_meshes,
        rngs=nnx.Rngs(0),
        dtype=precision.compute_dtype,
    )
    precision.apply_to(model)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    step = mp.jit(
        _step_for(precision),
        mesh=mesh,
        schedule=mp.OneFOneB(),
        num_microbatches=args.microbatches,
    )
    return nnx.cached_partial(step, model, optimizer)


def _time(variants: dict[str, Any], batch: Any, rounds: int) -> tuple[dict, dict]:
    """Median seconds per step of each variant, alternating rounds; and the last losses."""
    losses: dict[str, float] = {}
    for f in variants.values():  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(f(batch))
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, f in variants.items():
            for _ in range(STEPS_PER_ROUND):
                start = time.perf_counter()
                loss = jax.block_until_ready(f(batch))
                times[name].append(time.perf_counter() - start)
            losses[name] = float(loss)
    return {k: statistics.median(v) for k, v in times.items()}, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--num-meshes", type=int, default=2)
    parser.add_argument("--data", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    devices = jax.devices()[: args.num_meshes * args.data]
    mesh = mp.MpmdMesh(
        jax.make_mesh((args.num_meshes, args.data), ("stage", "data"), devices=devices), "stage"
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(args.batch, args.seq + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    variants = {
        "float32": _variant(args, mp.Precision(), mesh),
        "bfloat16": _variant(args, mp.Precision(compute_dtype=jnp.bfloat16), mesh),
    }
    seconds, losses = _time(variants, batch, args.rounds)
    kind = jax.devices()[0].device_kind
    print(f"{kind}, jax {jax.__version__}; {args.model} {args.preset}, batch {args.batch} x "
          f"{args.seq}, {args.num_meshes} meshes x {args.data} data, 1F1B, "
          f"m={args.microbatches}, AdamW; {args.rounds} alternating rounds of "
          f"{STEPS_PER_ROUND} steps")  # fmt: skip
    print("| device | model | float32 ms/step | bf16 ms/step | bf16 / float32 | "
          "loss float32 / bf16 |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    f32, bf16 = seconds["float32"], seconds["bfloat16"]
    print(f"| {kind} | {args.model} {args.preset} b{args.batch}x{args.seq} "
          f"{args.num_meshes}x{args.data} | {1e3 * f32:.1f} | {1e3 * bf16:.1f} | "
          f"{bf16 / f32:.2f} | {losses['float32']:.4f} / {losses['bfloat16']:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
