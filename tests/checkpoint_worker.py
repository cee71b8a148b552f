"""Subprocess script for the checkpoint fault tests (not collected by pytest).

Modes:
  kill-during-save DIR
      Saves step 1 (small), then starts an asynchronous save of step 2 holding a
      large array and SIGKILLs itself as soon as orbax's temporary directory for
      step 2 appears, i.e. while the files are being written.
  train DIR STEPS [--kill-at K]
      Deterministic training of the test model with a CheckpointManager saving
      every step with ``{"data_position": ...}`` metadata. Resumes from the latest
      finished step if there is one. Prints one JSON line per step:
      ``{"step": s, "loss": "<float repr>"}``. With ``--kill-at K`` it SIGKILLs
      itself right after starting the save of step K (the save is in flight).

Run it bounded, e.g. ``timeout -k 5 60 python tests/checkpoint_worker.py ...``.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import signal
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from checkpoint_helpers import Net, batch_at, make_optimizer, train_step

from nnx_mpmd.checkpoint import CheckpointManager

BIG_ELEMENTS = 48 * 1024 * 1024  # 192 MiB of float32: writing it takes a while


def kill_self() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def written_bytes(directory: Path, prefix: str) -> int:
    total = 0
    for tmp in directory.glob(prefix + "*"):
        total += sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    return total


def kill_when_step_dir_is_being_written(directory: Path, step: int) -> None:
    """SIGKILLs this process once orbax has written part of the step's array data."""
    prefix = f"{step}.orbax-checkpoint-tmp"
    while True:
        try:
            written = written_bytes(directory, prefix)
        except FileNotFoundError:  # files renamed while we looked
            written = 0
        if written > 4 * 1024 * 1024:
            print(f"KILLING after {written} bytes", flush=True)
            kill_self()
        time.sleep(0.001)


def kill_during_save(directory: Path) -> None:
    mgr = CheckpointManager(directory, async_save=True)
    mgr.save(1, {"w": jnp.arange(1000.0), "big": jnp.zeros(8)}, metadata={"data_position": 1})
    mgr.wait_until_finished()
    print("SAVED 1", flush=True)
    watcher = threading.Thread(
        target=kill_when_step_dir_is_being_written, args=(directory, 2), daemon=True
    )
    watcher.start()
    big = jax.random.normal(jax.random.key(0), (BIG_ELEMENTS,))
    mgr.save(2, {"w": jnp.arange(1000.0) + 1, "big": big}, metadata={"data_position": 2})
    mgr.wait_until_finished()
    print("FINISHED 2 (not killed)", flush=True)


def train(directory: Path, steps: int, kill_at: int | None) -> None:
    model = Net((0, 0, 1, 1), seed=0)
    optimizer = make_optimizer(model)
    mgr = CheckpointManager(directory, async_save=True)
    position = 0
    if mgr.latest_step() is not None:
        mgr.restore({"model": model, "optimizer": optimizer})
        position = mgr.metadata()["data_position"]
        print(json.dumps({"resumed_from": mgr.latest_step()}), flush=True)
    while position < steps:
        x, y = batch_at(position)
        loss = train_step(model, optimizer, jnp.asarray(x), jnp.asarray(y))
        print(json.dumps({"step": position, "loss": repr(float(loss))}), flush=True)
        position += 1
        mgr.save(position, {"model": model, "optimizer": optimizer}, {"data_position": position})
        if kill_at == position:
            kill_self()
    mgr.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["kill-during-save", "train"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("steps", type=int, nargs="?", default=0)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    if args.mode == "kill-during-save":
        kill_during_save(args.directory)
    else:
        train(args.directory, args.steps, args.kill_at)


if __name__ == "__main__":
    main()
