"""``nnx-mpmd plan``: choose the pipeline configuration of a model-zoo run.

Takes the options of ``nnx-mpmd train`` (model, preset, meshes, data, batch
size, ...), builds that run's model, mesh, optimizer and first batch, and
runs `nnx_mpmd.planner.plan` on them: every layer is timed and measured on one
submesh, then the split, schedule, microbatches and remat are searched with
the simulator. The SPMD alternatives on the same devices (data parallel and
FSDP over all of them, with microbatch accumulation) are predicted too and
ranked with the pipelines. It prints the ranking, optionally runs the top K
(``--verify K``: predicted against measured, and the fastest measured comes
first), states in one line whether pipelining pays, and writes the plan for
``nnx-mpmd train --plan FILE``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time
from typing import Any

from nnx_mpmd.apps.train import configure_compile_cache
from nnx_mpmd.apps.train_args import TrainConfig, set_cpu_devices
from nnx_mpmd.apps.train_args import build_parser as build_train_parser

__all__ = ["TRAIN_ONLY", "build_parser", "main", "train_only_given"]

#: ``nnx-mpmd train`` options that change nothing the planner measures (the run's
#: length, its outputs, checkpoints, evaluation): hidden from ``plan --help``, refused.
TRAIN_ONLY = (
    *("--steps", "--stop-at", "--lr", "--warmup", "--run-dir", "--ckpt-every", "--keep"),
    *("--resume", "--allow-changed-settings", "--profile", "--log-every", "--val-batches"),
    *("--sample-tokens", "--plan"),
)


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    """``nnx-mpmd train``'s options plus the planner's.

    Example:
      >>> build_parser().parse_args(["--verify", "2", "--budget-mib", "64"]).verify
      2
    """
    p = build_train_parser()
    p.prog = "nnx-mpmd plan"
    p.description = (
        "Choose the layer split, schedule, microbatches and remat of a model-zoo run by "
        "measuring its layers on the real devices and simulating every schedule; writes the "
        "plan (plan.json in the current directory, or --out) for nnx-mpmd train --plan FILE."
    )
    for action in p._actions:  # argparse has no public way to hide an inherited option
        if set(action.option_strings) & set(TRAIN_ONLY):
            action.help = argparse.SUPPRESS
    g = p.add_argument_group("planner")
    g.add_argument(
        "--out",
        default="plan.json",
        help="where to write the plan, a JSON file (default: plan.json in the current directory)",
    )
    g.add_argument("--budget-mib", type=float, default=None, help="memory per device, MiB")
    g.add_argument("--schedules", default=None, help="comma-separated names (default: all)")
    g.add_argument(
        "--candidate-microbatches",
        default=None,
        help="comma-separated counts (default: 1, 2 and 4 times --meshes where they divide)",
    )
    g.add_argument("--no-remat", action="store_true", help="never recompute a stage's forward")
    g.add_argument("--verify", type=int, default=0, metavar="K", help="run the top K and compare")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per layer profile")
    g.add_argument(
        "--no-spmd",
        action="store_true",
        help="do not rank data parallel and FSDP over all devices beside the pipelines",
    )
    return p


def train_only_given(argv: list[str]) -> list[str]:
    """The options of ``argv`` that only ``nnx-mpmd train`` uses (`TRAIN_ONLY`).

    Example:
      >>> train_only_given(["--meshes", "2", "--resume", "--sample-tokens=0"])
      ['--resume', '--sample-tokens']
    """
    return [arg.split("=")[0] for arg in argv if arg.split("=")[0] in TRAIN_ONLY]


def _say(text: str) -> None:
    print(text, flush=True)


def _verification_table(verifications: list[Any]) -> str:
    from nnx_mpmd.planner import SpmdCandidate

    lines = [
        "| schedule | stages | m | predicted ms | measured ms | time error | predicted peak MiB "
        "| measured peak MiB | memory error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for v in verifications:
        c = v.candidate
        if isinstance(c, SpmdCandidate):
            name, stages = c.label.split(", m=")[0], "-"
        else:
            name, stages = c.schedule, str(c.num_stages)
        lines.append(
            f"| {name} | {stages} | {c.num_microbatches} | {1e3 * c.step_s:.2f} | "
            f"{1e3 * v.measured_step_s:.2f} | {v.time_error:+.0%} | "
            f"{max(c.peak_bytes) / 2**20:.2f} | {max(v.measured_peak_bytes) / 2**20:.2f} | "
            f"{v.memory_error:+.0%} |"
        )
    return "\n".join(lines)


def run(cfg: Any) -> Any:
    """Plans the run ``cfg`` describes, writes ``cfg.out`` and returns the `Plan`."""
    from nnx_mpmd.apps.pretrained import apply_init_from
    from nnx_mpmd.apps.train_loop import Trainer

    with tempfile.TemporaryDirectory(prefix="nnx-mpmd-plan-") as scratch:
        # --init-from: the checkpoint's family, depth and tokenizer, as train takes them.
        apply_init_from(cfg, pathlib.Path(scratch))
        trainer = Trainer(cfg, pathlib.Path(scratch))  # removed when planned
        return _plan_and_save(cfg, trainer)


def _plan_and_save(cfg: Any, trainer: Any) -> Any:
    """`run` with the model, batches and mesh of ``trainer``."""
    from nnx_mpmd.models import lm_loss
    from nnx_mpmd.planner import plan, verify

    batch = next(trainer.batches)
    tx = trainer.optimizer.tx
    counts = _names(cfg.candidate_microbatches)
    budget = None if cfg.budget_mib is None else int(cfg.budget_mib * 2**20)
    out = pathlib.Path(cfg.out).resolve()
    _say(
        f"planning {_model_name(cfg)} ({trainer.num_layers} layers) for {cfg.meshes} "
        f"meshes x {cfg.data} data, batch {cfg.batch_size}; the plan goes to {out}"
    )
    _say(
        "profiling every layer on one submesh (compiling and timing its forward and backward"
        + (", with and without remat" if not cfg.no_remat else "")
        + f", {cfg.repeats} timed runs each), then simulating every schedule: about a minute "
        "or two on a 2-core CPU..."
    )
    started = time.perf_counter()
    planned = plan(
        trainer.model, lm_loss, batch, trainer.mesh, tx,
        schedules=_names(cfg.schedules),
        num_microbatches=None if counts is None else [int(c) for c in counts],
        memory_budget=budget, remat=not cfg.no_remat, repeats=cfg.repeats,
        donate=not cfg.no_donate, spmd=not cfg.no_spmd,
    )  # fmt: skip
    _say(f"profiled and searched in {time.perf_counter() - started:.0f} s")
    _say(planned.summary())
    if cfg.verify:
        _say(f"verifying: compiling and running the top {cfg.verify} configurations...")
        checked = verify(planned, trainer.model, lm_loss, batch, trainer.mesh, tx, top=cfg.verify)
        _say(_verification_table(checked))
        planned = planned.with_measurements(checked)
    _say(planned.verdict())
    planned.save(cfg.out)
    best = planned.best
    print(
        f"wrote {out}: {best.schedule}, {best.num_stages} stages, {best.num_microbatches} "
        f"microbatches; train with: nnx-mpmd train --plan {cfg.out} --meshes {cfg.meshes} "
        f"--data {cfg.data} --batch-size {cfg.batch_size}{_model_options(cfg)}"
    )
    return planned


def _model_name(cfg: TrainConfig) -> str:
    """The planned model as the log names it: the family and preset, or the checkpoint."""
    if getattr(cfg, "init_from", None):
        return f"{cfg.model} from {cfg.init_from}"
    return f"{cfg.model} {cfg.preset}"


def _model_options(cfg: TrainConfig) -> str:
    """The options that built the planned model, for the ``train`` command to repeat."""
    options = []
    if getattr(cfg, "init_from", None):  # the checkpoint fixes the family and depth
        options.append(f"--init-from {cfg.init_from}")
    else:
        if cfg.model != "gpt" or cfg.preset != "tiny":
            options += [f"--model {cfg.model}", f"--preset {cfg.preset}"]
        if cfg.layers is not None:
            options.append(f"--layers {cfg.layers}")
    if cfg.seq_len is not None:
        options.append(f"--seq-len {cfg.seq_len}")
    if cfg.scan_layers:
        options.append("--scan-layers")
    return "".join(f" {option}" for option in options)


def _launched_processes() -> int:
    """How many processes `nnx-mpmd launch` (or a cluster launcher) started, 1 if none."""
    import os

    from nnx_mpmd.runtime.multi_process import ENV_NUM_PROCESSES

    try:
        return max(1, int(os.environ.get(ENV_NUM_PROCESSES, "1")))
    except ValueError:
        return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnx-mpmd plan``: 0 on success, 2 on bad input."""
    from nnx_mpmd.errors import MpmdError

    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = build_parser().parse_args(argv, namespace=TrainConfig())
    ignored = train_only_given(argv)
    if ignored:
        print(
            f"nnx-mpmd plan: error: {', '.join(ignored)} belong(s) to nnx-mpmd train only "
            "(nothing the planner measures depends on them); give them to "
            "nnx-mpmd train --plan FILE",
            file=sys.stderr,
        )
        return 2
    if cfg.verify < 0 or cfg.repeats < 1:
        print("nnx-mpmd plan: error: --verify must be >= 0 and --repeats >= 1", file=sys.stderr)
        return 2
    launched = _launched_processes()
    if launched > 1:
        print(
            f"nnx-mpmd plan: error: this is one of {launched} launched processes, but the "
            "planner runs in one process (it times layers and --verify runs on this process's "
            "devices). Run `nnx-mpmd plan` without the launcher, on one host with --meshes x "
            "--data devices (CPU: --devices N), then `nnx-mpmd launch ... -- nnx-mpmd train "
            "--plan FILE` with the same --meshes and --data.",
            file=sys.stderr,
        )
        return 2
    set_cpu_devices(cfg.devices)
    configure_compile_cache(cfg)
    try:
        run(cfg)
    except MpmdError as e:
        print(f"nnx-mpmd plan: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0
