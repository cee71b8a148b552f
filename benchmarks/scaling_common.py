"""Shared parts of the scaling benchmarks (``scaling_host_bench.py``, ``scaling_compile_bench.py``).

A toy pipeline whose size is the point: ``num_stages`` meshes of one CPU
device each, one ``Linear(16, 16)`` (or a block of them) per stage, so the
programs are tiny and what grows with the work is the framework's own cost.
Also: a growth fit (the exponent of a power law through the points) and one
PNG per figure.

Example:
    >>> round(growth_exponent([10, 100, 1000], [1.0, 10.0, 100.0]), 2)
    1.0
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

WIDTH = 16


def setup_devices(count: int) -> None:
    """Asks for ``count`` simulated CPU devices; must run before JAX's backend starts.

    Args:
      count: how many CPU devices the process needs (one per stage).
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_num_cpu_devices < count:
        jax.config.update("jax_num_cpu_devices", count)
    if jax.device_count() < count:
        raise SystemExit(
            f"needs {count} CPU devices but JAX has {jax.device_count()}; run the script in "
            "a fresh process (nothing may start JAX's backend before it)."
        )


def stage_mesh(num_stages: int) -> Any:
    """An `MpmdMesh` of ``num_stages`` meshes of one device each."""
    import jax

    import nnx_mpmd as mp

    devices = jax.devices()[:num_stages]
    return mp.MpmdMesh(jax.make_mesh((num_stages, 1), ("stage", "data"), devices=devices), "stage")


def mlp_model(num_stages: int, layers_per_stage: int = 1, *, scan: bool = False) -> Any:
    """A pipelined MLP: ``layers_per_stage`` Linear+tanh layers on each of ``num_stages`` stages.

    With ``scan`` the layers are one `mp.ScanStack` split into equal ranges, so
    each stage traces one block and scans it (compile time flat in layers).
    """
    import jax.numpy as jnp
    from flax import nnx

    import nnx_mpmd as mp

    class Layer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return jnp.tanh(self.linear(x))

    class Unrolled(mp.PipelinedModel):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List(
                [
                    mp.Stage(Layer(rngs), stage=i // layers_per_stage)
                    for i in range(num_stages * layers_per_stage)
                ]
            )

        def __call__(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    class Scanned(mp.PipelinedModel):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.blocks = mp.ScanStack(Layer, num_stages * layers_per_stage, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.blocks(x)

    if not scan:
        return Unrolled(nnx.Rngs(0))
    model = Scanned(nnx.Rngs(0))
    n = layers_per_stage
    mp.assign_stages(model, {f"blocks[{s * n}:{(s + 1) * n}]": s for s in range(num_stages)})
    return model


def train_step(model: Any, optimizer: Any, batch: Any) -> Any:
    """Mean squared error of the MLP, its gradient and an SGD update."""
    import jax.numpy as jnp

    import nnx_mpmd as mp

    def loss_fn(m: Any, b: Any) -> Any:
        return jnp.mean((m(b["x"]) - b["y"]) ** 2)

    loss, grads = mp.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def pipelined(
    num_stages: int,
    num_microbatches: int,
    layers_per_stage: int = 1,
    *,
    scan: bool = False,
    schedule: str = "1f1b",
) -> tuple[Any, tuple[Any, Any], dict[str, Any]]:
    """A fresh ``mp.jit`` step, its ``(model, optimizer)`` and one batch (a row per microbatch)."""
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import nnx_mpmd as mp

    model = mlp_model(num_stages, layers_per_stage, scan=scan)
    optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)
    schedules = {"1f1b": mp.OneFOneB, "gpipe": mp.GPipe}
    step = mp.jit(
        train_step,
        mesh=stage_mesh(num_stages),
        schedule=schedules[schedule](),
        num_microbatches=num_microbatches,
    )
    rng = np.random.default_rng(0)
    batch = {
        k: jnp.asarray(rng.normal(size=(num_microbatches, WIDTH)).astype(np.float32))
        for k in ("x", "y")
    }
    return step, (model, optimizer), batch


def seconds(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of one call of ``fn``, and its result."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def growth_exponent(sizes: Sequence[float], times: Sequence[float]) -> float:
    """The least-squares slope of log(time) against log(size): 1 is linear, 2 quadratic.

    Args:
      sizes: the work (tasks, layers...), all > 0.
      times: the seconds at each size, all > 0.

    Returns:
      The exponent ``b`` of the power law ``time ~ a * size**b`` fitted to the points.
    """
    xs = [math.log(s) for s in sizes]
    ys = [math.log(max(t, 1e-12)) for t in times]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


def nlogn_exponent(sizes: Sequence[float]) -> float:
    """The exponent an n log n curve shows over ``sizes`` (a pass fitting above it grows faster)."""
    return growth_exponent(sizes, [s * math.log(s) for s in sizes])


def plot_lines(
    path: str,
    title: str,
    xlabel: str,
    ylabel: str,
    lines: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    logx: bool = True,
    logy: bool = True,
    hline: tuple[float, str] | None = None,
) -> str:
    """One figure with a line per entry of ``lines`` (label: (xs, ys)), written as PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for label, (xs, ys) in lines.items():
        ax.plot(xs, ys, marker="o", label=label)
    if hline is not None:
        ax.axhline(hline[0], color="grey", linestyle="--", label=hline[1])
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats printed with 3 significant digits."""

    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
