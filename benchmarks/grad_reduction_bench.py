"""Gradient reduction per step: bytes reduced and step time, before and after.

Measures three configurations, each pipelined on 4 meshes x 2 data devices
(Explicit axes unless said, 1F1B, m=8), with two versions of the code side by side in one
run: ``--before`` (a checkout of the code before the change, e.g.
``git worktree add /tmp/before-gradred <rev>``) and ``--after`` (default: this
checkout):

* ``gpt``: GPT ``tiny`` (nnx_mpmd.models, tied embeddings), parameters
  replicated over the data axis (their gradients are all-reduced);
* ``gpt-auto``: the same on Auto mesh axes (stacked partial sums);
* ``fsdp``: one 256x256 Linear per stage whose kernel is sharded over the data
  axis (FSDP, ``out_sharding=("data", None)``; its gradient is
  reduce-scattered), the bias replicated.

For each version and configuration, a worker process (8 CPU devices) reports:

* the bytes reduced per step, counted from the compiled HLO of the programs a
  step executes (each program's all-reduce result bytes plus reduce-scatter
  operand bytes, times how many times the instruction list calls it), over
  the model's parameter bytes (XLA on CPU writes a reshard to a data-sharded
  type as an all-reduce and a slice: counted as all-reduced);
* the median step time over ``--steps`` steps after 2 warm-up steps.

Workers run alternately, ``--rounds`` times each, and the step-time ratio
after/before is the ratio of the medians over rounds. Prints a table and writes
``benchmarks/results/<date>-grad-reduction.json``.

Run: ``.venv/bin/python benchmarks/grad_reduction_bench.py --before /tmp/before-gradred``
(``--config fsdp`` for one configuration only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _gpt(microbatches: int):
    """GPT tiny on 4 stages: (model, loss_fn, batch)."""
    import numpy as np
    import optax
    from flax import nnx

    from nnx_mpmd.models import GPT, GPTConfig

    cfg = GPTConfig.preset("tiny", num_stages=4)
    model = GPT(cfg, rngs=nnx.Rngs(0))

    def loss_fn(model, batch):
        logits = model(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.vocab_size, size=(4 * microbatches, 33)).astype(np.int32)
    return model, loss_fn, batch


def _fsdp(microbatches: int, width: int = 256):
    """One Linear+tanh per stage (4 stages), its kernel FSDP-sharded over "data"."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import nnx_mpmd as mp

    class FsdpStages(mp.PipelinedModel):
        def __init__(self, rngs: nnx.Rngs) -> None:
            meta = {"out_sharding": ("data", None), "eager_sharding": False}
            self.layers = nnx.List(
                [
                    mp.Stage(nnx.Linear(width, width, kernel_metadata=meta, rngs=rngs), stage=s)
                    for s in range(4)
                ]
            )

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    def loss_fn(model, batch):
        return jnp.mean((model(batch) - 0.5) ** 2)

    rng = np.random.default_rng(0)
    batch = rng.normal(size=(4 * microbatches, width)).astype(np.float32)
    return FsdpStages(nnx.Rngs(0)), loss_fn, batch


def worker(steps: int, microbatches: int, config: str = "gpt") -> dict:
    """One version's figures (runs inside a worker process, importing that version)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import optax
    from flax import nnx

    import nnx_mpmd as mp
    from nnx_mpmd.compiler.ir import Call

    model, loss_fn, batch = (_fsdp if config == "fsdp" else _gpt)(microbatches)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    types = (
        jax.sharding.AxisType.Auto if config == "gpt-auto" else jax.sharding.AxisType.Explicit,
    )
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data"), axis_types=types * 2), "stage")

    def step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    f = mp.jit(step, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=microbatches)
    lowered = f.lower(model, optimizer, batch)
    executables = lowered.compile().executables()
    calls: dict[str, int] = {}
    for ins in lowered.compiled.instructions:
        if isinstance(ins, Call):
            calls[str(ins.program)] = calls.get(str(ins.program), 0) + 1
    texts = {name: executables[name][0].as_text() for name in calls if executables.get(name)}
    all_reduced = sum(
        n * _all_reduce_bytes(texts[name]) for name, n in calls.items() if name in texts
    )
    scattered = sum(
        n * _reduce_scatter_bytes(texts[name]) for name, n in calls.items() if name in texts
    )
    params = nnx.state(model, nnx.Param)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        float(f(model, optimizer, batch))
        if i >= 2:
            times.append(time.perf_counter() - start)
    return {
        "all_reduce_bytes_per_step": all_reduced,
        "reduce_scatter_bytes_per_step": scattered,
        "param_bytes": param_bytes,
        "ratio": (all_reduced + scattered) / param_bytes,
        "step_s": statistics.median(times),
        "calls": len([n for n in calls if n.startswith("reduce")]),
    }


def _shape_bytes(text: str) -> int:
    import re

    sizes = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4}
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", text):
        count = 1
        for d in dims.split(","):
            count *= int(d) if d else 1
        total += count * sizes.get(dtype, 8 if "64" in dtype else 4)
    return total


def _reduce_scatter_bytes(text: str) -> int:
    """Operand bytes of every reduce-scatter in an HLO module's text: its result's size
    times its group size (local, like `_all_reduce_bytes`)."""
    import re

    pattern = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+reduce-scatter\(")
    total = 0
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            groups = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
            iota = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
            size = len(groups.group(1).split(",")) if groups else 1
            size = int(iota.group(1).split(",")[-1]) if iota else size
            total += _shape_bytes(match.group(1)) * size
    return total


def _all_reduce_bytes(text: str) -> int:
    """Bytes of every all-reduce result in an HLO module's text (kept local so that
    the code before the change, which lacks `grad_reduction`, is measured the same way)."""
    import re

    pattern = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+all-reduce(?:-start)?\(")
    matches = (pattern.match(line) for line in text.splitlines())
    return sum(_shape_bytes(m.group(1)) for m in matches if m)


def run_worker(root: str, steps: int, microbatches: int, config: str) -> dict:
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--config", config]
    command += ["--steps", str(steps), "--microbatches", str(microbatches)]
    out = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"worker for {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


SETUPS = {
    "gpt": "GPT tiny",
    "gpt-auto": "GPT tiny on Auto axes",
    "fsdp": "4 x Linear(256, 256), kernels FSDP-sharded over data",
}


def _summary(args: argparse.Namespace, config: str) -> dict:
    """Both versions' figures for one configuration, workers alternating."""
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, root in (("before", args.before), ("after", args.after)):
            runs[name].append(
                run_worker(os.path.abspath(root), args.steps, args.microbatches, config)
            )
    summary: dict = {}
    for name, results in runs.items():
        summary[name] = dict(results[0], step_s=statistics.median(r["step_s"] for r in results))
    summary["step_time_ratio_after_over_before"] = (
        summary["after"]["step_s"] / summary["before"]["step_s"]
    )
    summary["setup"] = (
        f"{SETUPS[config]}, 4 meshes x 2 data, 1F1B, m={args.microbatches}, "
        f"CPU 8 devices, {args.steps} steps x {args.rounds} rounds per version, alternating"
    )
    print(f"{config}: {summary['setup']}")
    for name in ("before", "after"):
        s = summary[name]
        print(
            f"{name:>6}: all-reduced {s['all_reduce_bytes_per_step']:>9} B/step, "
            f"reduce-scattered {s.get('reduce_scatter_bytes_per_step', 0):>9} B/step = "
            f"{s['ratio']:.3f} x params ({s['param_bytes']} B), step {s['step_s'] * 1e3:.2f} ms"
        )
    print(f"step time after/before: {summary['step_time_ratio_after_over_before']:.3f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required="--worker" not in sys.argv)
    parser.add_argument("--after", default=os.path.dirname(HERE))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--config", choices=["all", *SETUPS], default="all")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker:
        config = "gpt" if args.config == "all" else args.config
        print(json.dumps(worker(args.steps, args.microbatches, config)))
        return
    configs = list(SETUPS) if args.config == "all" else [args.config]
    results = {config: _summary(args, config) for config in configs}
    # The GPT figures stay at the top level (the layout of earlier result files).
    summary = dict(results.pop("gpt", {}), **results)
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(HERE, "results", f"{date}-grad-reduction.json")
    with open(out, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
