"""Peak memory per mesh with and without donating the model's and optimizer's state.

For each GPT preset given, the 1F1B step (4 meshes x 2 data, Adam, m = 4)
runs twice in one process: with ``mp.jit(..., donate_argnums=())`` and with
``donate_argnums=(0, 1)``. Each is called once, then once with
``memory=True``; the table gives every mesh's peak live bytes per device
(`step.last_memory["peak_bytes"]`), the instruction at the peak, and the
bytes held before the step (parameters and optimizer state). The losses of
three steps must be equal with and without donation.

Run: ``.venv/bin/python benchmarks/donation_memory.py --presets tiny,small``
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax
from flax import nnx

import nnx_mpmd as mp
from nnx_mpmd.apps.train_loop import train_step
from nnx_mpmd.models import build_model


def measure(preset: str, donate: tuple[int, ...], batch_rows: int, seq: int) -> dict:
    """Losses of three steps, then one step's memory, for one setting."""
    mesh = mp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
    model = build_model("gpt", preset, num_stages=4, rngs=nnx.Rngs(0), vocab_size=256)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    step = mp.jit(
        train_step, mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=4, donate_argnums=donate
    )
    tokens = np.random.default_rng(0).integers(0, 256, (batch_rows, seq + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    losses = [float(step(model, optimizer, batch)) for _ in range(3)]
    step(model, optimizer, batch, memory=True)
    memory = step.last_memory
    timeline = memory["timeline"]
    at_peak = []
    for q in range(len(memory["peak_bytes"])):
        row = max(timeline, key=lambda r: r[2][q])
        at_peak.append(row[1])
    return {
        "losses": losses,
        "peak": memory["peak_bytes"],
        "initial": memory["initial_bytes"],
        "at_peak": at_peak,
    }


def _mib(values) -> str:
    return " / ".join(f"{v / 2**20:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    print("| preset | donation | state MiB per mesh | peak MiB per mesh | where each mesh peaks |")
    print("| --- | --- | --- | --- | --- |")
    for preset in args.presets.split(","):
        kept = measure(preset, (), args.batch, args.seq)
        donated = measure(preset, (0, 1), args.batch, args.seq)
        assert kept["losses"] == donated["losses"], (kept["losses"], donated["losses"])
        for name, row in (("none", kept), ("(0, 1)", donated)):
            where = " / ".join(row["at_peak"])
            print(f"| {preset} | {name} | {_mib(row['initial'])} | {_mib(row['peak'])} | {where} |")


if __name__ == "__main__":
    main()
