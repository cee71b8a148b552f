"""Steps called directly against steps under ``nnx.cached_partial``, side by side.

For GPT presets, four variants of the same microbatched train step (m = 8,
batch 64, AdamW), timed in interleaved rounds in one process:

* ``mp.jit`` (1F1B on ``--num-meshes`` x ``--data`` devices) called as
  ``step(model, optimizer, batch)``, which walks the NNX graph on every call;
* the same step through ``nnx.cached_partial(step, model, optimizer)``;
* ``nnx.jit`` of the step with ``mp.value_and_grad(..., num_microbatches=8)``
  on one device, called directly and through ``nnx.cached_partial``.

Prints the median step time (each step waited for), its ratio to the direct
``nnx.jit`` call, and the median time until the call returns. Runs on the
default backend: ``JAX_PLATFORMS=cuda`` for a GPU (one mesh of one device
there: ``--num-meshes 1 --data 1``, the default), 8 simulated CPU devices
otherwise. Usage::

    python benchmarks/cached_partial_bench.py [--presets tiny,small] [--seq 32,256]
        [--num-meshes 1] [--data 1] [--rounds 7]
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
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.models import build_model, lm_loss

M = 8


def _step(model: Any, optimizer: Any, batch: dict[str, Any]) -> Any:
    loss, grads = mp.value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def _reference(model: Any, optimizer: Any, batch: dict[str, Any]) -> Any:
    loss, grads = mp.value_and_grad(lm_loss, num_microbatches=M)(model, batch)
    optimizer.update(model, grads)
    return loss


def _variants(preset: str, num_stages: int, mesh: mp.MpmdMesh) -> dict[str, Callable[..., Any]]:
    def make(stages: int) -> tuple[Any, Any]:
        model = build_model("gpt", preset, num_stages=stages, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    out: dict[str, Callable[..., Any]] = {}
    for cached in (False, True):
        model, opt = make(num_stages)
        step = mp.jit(_step, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=M)
        out[f"mp.jit {'cached_partial' if cached else 'direct'}"] = (
            nnx.cached_partial(step, model, opt) if cached else _bound(step, model, opt)
        )
    for cached in (False, True):
        model, opt = make(1)
        step = nnx.jit(_reference)
        out[f"nnx.jit {'cached_partial' if cached else 'direct'}"] = (
            nnx.cached_partial(step, model, opt) if cached else _bound(step, model, opt)
        )
    return out


def _bound(step: Callable[..., Any], model: Any, opt: Any) -> Callable[..., Any]:
    return lambda batch: step(model, opt, batch)


def _time(variants: dict[str, Callable[..., Any]], batch: Any, rounds: int) -> dict[str, Any]:
    for f in variants.values():
        for _ in range(3):
            jax.block_until_ready(f(batch))
    times: dict[str, list[float]] = {k: [] for k in variants}
    returns: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, f in variants.items():
            for _ in range(5):
                start = time.perf_counter()
                out = f(batch)
                returned = time.perf_counter() - start
                jax.block_until_ready(out)
                times[name].append(time.perf_counter() - start)
                returns[name].append(returned)
    return {k: (statistics.median(times[k]), statistics.median(returns[k])) for k in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--seq", default="32,256", help="tokens per sequence, one per preset")
    parser.add_argument("--num-meshes", type=int, default=1)
    parser.add_argument("--data", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    devices = jax.devices()[: args.num_meshes * args.data]
    mesh = mp.MpmdMesh(
        jax.make_mesh((args.num_meshes, args.data), ("stage", "data"), devices=devices), "stage"
    )
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"{args.num_meshes} meshes x {args.data} data, 1F1B, m={M}, batch 64")  # fmt: skip
    print("| preset | variant | median ms | / nnx.jit direct | call returns ms |")
    print("| --- | --- | --- | --- | --- |")
    for preset, seq in zip(args.presets.split(","), map(int, args.seq.split(",")), strict=True):
        tokens = np.random.default_rng(0).integers(0, 256, size=(64, seq + 1)).astype(np.int32)
        batch = {"inputs": jax.device_put(tokens[:, :-1]), "targets": jax.device_put(tokens[:, 1:])}
        variants = _variants(preset, args.num_meshes, mesh)
        results = _time(variants, batch, args.rounds)
        base = results["nnx.jit direct"][0]
        for name, (step_s, return_s) in results.items():
            print(f"| {preset} | {name} | {1e3 * step_s:.1f} | {step_s / base:.2f} | "
                  f"{1e3 * return_s:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
