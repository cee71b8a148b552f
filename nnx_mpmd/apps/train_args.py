"""The options of ``nnx-mpmd train``: its parser, `TrainConfig` and their checks.

`config_from_args` layers the parser's defaults, a resumed run's saved
``config.toml``, ``--config FILE.toml`` and the command line
(`nnx_mpmd.apps.train_config`), then checks everything that needs no JAX.
The trainer, ``nnx-mpmd convert`` and ``nnx-mpmd plan`` read the options from
here, below `nnx_mpmd.apps.train` (which runs them), so the command-line apps
import one way. `nnx_mpmd.apps.train` re-exports the public names.

JAX is imported only after the simulated CPU device count is set, so this
module must not import JAX at the top level.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Any, cast

from nnx_mpmd.apps.run_dir import resolve_run_dir, reuse_run_tokenizer
from nnx_mpmd.apps.train_config import (
    CONFIG_FILE,
    config_keys,
    parse_layered,
    read_config_file,
    resolved_config,
)

__all__ = [
    "DEVICE_COUNT_FLAG",
    "HelpFormatter",
    "TrainConfig",
    "apply_plan_file",
    "build_parser",
    "config_from_args",
    "set_cpu_devices",
    "train_config_values",
]

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


class TrainConfig(argparse.Namespace):
    """The parsed options of ``nnx-mpmd train`` (an ``argparse.Namespace``).

    Example:
      >>> cfg = config_from_args(["--steps", "3"])
      >>> cfg.steps, cfg.model, cfg.schedule
      (3, 'gpt', '1f1b')
    """

    model: str
    preset: str
    schedule: str
    meshes: int
    data: int
    stages: int | None
    layers: int | None
    scan_layers: bool
    microbatches: int
    batch_size: int
    seq_len: int | None
    steps: int
    stop_at: int | None
    lr: float
    warmup: int
    seed: int
    corpus_bytes: int
    devices: int
    run_dir: str | None
    ckpt_every: int
    keep: int
    resume: bool
    resume_step: int | None
    allow_changed_settings: bool
    profile: bool
    log_every: int
    sample_tokens: int
    val_batches: int
    compile_cache: str | None
    no_compile_cache: bool
    no_donate: bool
    check_finite: bool
    skip_memory_check: bool
    plan: str | None
    # --- data (issue 48) ---
    dataset: str | None
    val_dataset: str | None
    val_fraction: float | None
    text_field: str
    tokenizer: str | None
    # --- evaluation, logging and config (issue 48) ---
    eval_every: int
    eval_batches: int
    peak_tflops: float | None
    tensorboard: bool
    config: str | None
    # --- precision (issue 48) ---
    dtype: str
    param_dtype: str
    # --- pretrained (issue 48) ---
    init_from: str | None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "(default" in text
            or default is None
            or default is False
            or default == argparse.SUPPRESS
        ):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nnx-mpmd train`` (its ``parse_args`` gives a `TrainConfig`).

    Example:
      >>> build_parser().parse_args(["--model", "llama"]).model
      'llama'
    """
    p = argparse.ArgumentParser(
        prog="nnx-mpmd train",
        description="Train a model-zoo language model on the Python standard library's "
        "source (or your files: --dataset, --tokenizer) with an MPMD pipeline schedule. "
        "Runs as several processes under "
        "nnx-mpmd launch --processes N -- nnx-mpmd train ...",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default="gpt", help="model family: gpt or llama")
    p.add_argument("--preset", default="tiny", help="model size: tiny, small, ...")
    p.add_argument(
        "--schedule",
        default="1f1b",
        help="gpipe, 1f1b, eager-1f1b, interleaved, looped-bfs, zb-h1, zb-h2, zb-v or dualpipev",
    )
    p.add_argument("--meshes", type=int, default=4, help="pipeline submeshes")
    p.add_argument("--data", type=int, default=2, help="data-parallel devices per submesh")
    p.add_argument(
        "--stages", type=int, default=None, help="logical stages (default: the schedule's)"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="blocks of the model (default: the preset's, raised to one per stage if fewer)",
    )
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="stack the blocks and scan them, one scanned chunk per stage (mp.ScanStack): "
        "compile time does not grow with --layers",
    )
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (default: the preset's context length)",
    )
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="stop after this step as if interrupted (the LR schedule still spans --steps)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW")
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--seed", type=int, default=0, help="seed of parameters and batches")
    p.add_argument(
        "--corpus-bytes", type=int, default=2_000_000, help="characters of stdlib source"
    )
    p.add_argument(
        "--devices",
        type=int,
        default=8,
        help=f"simulated CPU devices (ignored when XLA_FLAGS sets {DEVICE_COUNT_FLAG})",
    )
    p.add_argument("--run-dir", default=None, help="output directory (default: runs/TIME)")
    p.add_argument(
        "--ckpt-every", type=int, default=50, help="checkpoint period in steps (0: never)"
    )
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --run-dir (default: the newest run); "
        "a damaged or unfinished latest step is skipped with a warning",
    )
    p.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="N",
        help="with --resume: continue from step N (or the newest intact step before it); "
        "later steps are set aside as checkpoints/<step>.set-aside",
    )
    p.add_argument(
        "--allow-changed-settings",
        action="store_true",
        help="with --resume: continue even if --lr, --warmup, --steps, --batch-size, --seed, "
        "--seq-len, --corpus-bytes or --dtype differ from the saved run",
    )
    p.add_argument("--profile", action="store_true", help="time every task of one step and draw it")
    p.add_argument("--log-every", type=int, default=5, help="metrics period in steps")
    p.add_argument("--val-batches", type=int, default=4, help="held-out batches scored at the end")
    p.add_argument(
        "--sample-tokens", type=int, default=200, help="characters to generate at the end"
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache (default: $NNX_MPMD_COMPILE_CACHE, else "
        "~/.cache/nnx_mpmd/jax; a cache JAX_COMPILATION_CACHE_DIR sets wins)",
    )
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile every program, without reading or writing the compilation cache",
    )
    p.add_argument(
        "--no-donate",
        action="store_true",
        help="keep the old parameters and optimizer state beside the new ones in the "
        "update, instead of writing the new state into them (mp.jit's donate_argnums)",
    )
    p.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="start even if the parameters, optimizer state and gradients are predicted not "
        "to fit a device ($NNX_MPMD_DEVICE_MEMORY_BYTES, else the device's limit)",
    )
    p.add_argument(
        "--check-finite",
        action="store_true",
        help="check every stage's outputs and gradients for NaN/inf in each step and stop at "
        "the first, naming its stage and parameter path (mp.jit(check_finite=True); slower)",
    )
    p.add_argument(
        "--plan",
        default=None,
        metavar="FILE",
        help="a plan written by 'nnx-mpmd plan': its schedule, stages, microbatches, "
        "layer split and remat replace --schedule, --stages and --microbatches",
    )
    # --- data (issue 48) ---
    from nnx_mpmd.apps.datasets import add_data_arguments

    add_data_arguments(p)
    # --- evaluation, logging and config (issue 48) ---
    from nnx_mpmd.apps.train_metrics import add_reporting_arguments

    add_reporting_arguments(p)
    # --- precision (issue 48) ---
    p.add_argument(
        "--dtype",
        default="float32",
        metavar="{float32,bfloat16}",
        help="compute dtype of the forward and backward passes (mp.Precision); the loss "
        "stays float32",
    )
    p.add_argument(
        "--param-dtype",
        default="float32",
        metavar="{float32,bfloat16}",
        help="dtype the parameters and the optimizer state are stored and updated in",
    )
    # --- pretrained (issue 48) ---
    p.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="fine-tune a Hugging Face model directory (GPT-2 or Llama: config.json + "
        "model.safetensors [+ tokenizer.json]); its family and depth replace --model, "
        "--preset and --layers (see nnx-mpmd convert)",
    )
    return p


def apply_plan_file(cfg: TrainConfig) -> None:
    """Takes the schedule, stages and microbatches of ``cfg.plan`` (a plan's JSON), if given.

    The layer split and remat are applied to the model later, by the trainer.

    Raises:
      MpmdError: the file cannot be read or holds no plan (`PlanError`), or was planned
        for other meshes or batch size.
    """
    from nnx_mpmd.apps.validate_args import read_plan_settings
    from nnx_mpmd.errors import MpmdError

    if cfg.plan is None:
        return
    data = read_plan_settings(cfg.plan)
    planned = (data["num_meshes"], data["batch_size"])
    if planned != (cfg.meshes, cfg.batch_size):
        raise MpmdError(
            f"--plan {cfg.plan} was made for --meshes {planned[0]} --batch-size {planned[1]}, "
            f"not --meshes {cfg.meshes} --batch-size {cfg.batch_size}; pass those, or plan again."
        )
    cfg.schedule = data["schedule"]
    cfg.stages = data["num_stages"]
    cfg.microbatches = data["num_microbatches"]
    if data.get("donate") and cfg.no_donate:
        print(
            f"nnx-mpmd train: warning: --plan {cfg.plan} predicted its peaks for a step that "
            "donates its state; with --no-donate each mesh holds its state twice during the "
            "update, above those peaks. Drop --no-donate, or plan with it.",
            file=sys.stderr,
        )


def config_from_args(argv: list[str]) -> TrainConfig:
    """Parses and checks the options after ``train`` that need no JAX.

    Raises:
      MpmdError: an option out of range or a batch that does not split.

    Example:
      >>> config_from_args(["--batch-size", "16", "--microbatches", "4"]).batch_size
      16
    """
    from nnx_mpmd.apps.datasets import check_data_args
    from nnx_mpmd.apps.train_metrics import check_reporting_flags
    from nnx_mpmd.apps.validate_args import check_seed
    from nnx_mpmd.errors import MpmdError
    from nnx_mpmd.jit.precision import precision_from_names

    cfg = cast(TrainConfig, parse_layered(build_parser(), argv, TrainConfig(), _saved_config_path))
    reuse_run_tokenizer(cfg, _given_tokenizer(argv))  # --resume: the run's own copy
    check_reporting_flags(cfg)
    if cfg.plan is not None:
        apply_plan_file(cfg)
    positive = ("meshes", "data", "microbatches", "batch_size", "steps", "devices", "keep")
    positive += ("log_every",)
    for name in positive:
        if getattr(cfg, name) < 1:
            raise MpmdError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1.")
    for name in ("ckpt_every", "sample_tokens", "warmup", "val_batches"):
        if getattr(cfg, name) < 0:
            raise MpmdError(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 0.")
    if cfg.batch_size % cfg.microbatches:
        raise MpmdError(
            f"--batch-size={cfg.batch_size} is not divisible by --microbatches="
            f"{cfg.microbatches}; use a batch size that is a multiple of it, e.g. "
            f"{cfg.microbatches * max(1, cfg.batch_size // cfg.microbatches)}."
        )
    per_microbatch = cfg.batch_size // cfg.microbatches
    if per_microbatch % cfg.data:
        raise MpmdError(
            f"a microbatch of {per_microbatch} sequences (--batch-size={cfg.batch_size} / "
            f"--microbatches={cfg.microbatches}) does not split over --data={cfg.data} "
            f"devices; use --batch-size {cfg.microbatches * cfg.data * max(1, per_microbatch // cfg.data)}."
        )
    if cfg.stop_at is not None and not 1 <= cfg.stop_at <= cfg.steps:
        raise MpmdError(f"--stop-at={cfg.stop_at} must lie in [1, --steps={cfg.steps}].")
    if not 0 < cfg.lr < float("inf"):
        raise MpmdError(f"--lr={cfg.lr} must be a number > 0, e.g. 3e-3.")
    if cfg.layers is not None and cfg.layers < 1:
        raise MpmdError(f"--layers={cfg.layers} must be >= 1.")
    if cfg.seq_len is not None and cfg.seq_len < 1:
        raise MpmdError(f"--seq-len={cfg.seq_len} must be >= 1.")
    if cfg.stages is not None and cfg.stages < 1:
        raise MpmdError(f"--stages={cfg.stages} must be >= 1.")
    if cfg.corpus_bytes < 1:
        raise MpmdError(f"--corpus-bytes={cfg.corpus_bytes} must be >= 1.")
    check_seed(cfg.seed)
    check_data_args(cfg)
    precision_from_names(cfg.dtype, cfg.param_dtype)  # --- precision (issue 48) ---
    if cfg.allow_changed_settings and not cfg.resume:
        raise MpmdError("--allow-changed-settings only applies with --resume; add --resume.")
    if cfg.resume_step is not None and not cfg.resume:
        raise MpmdError("--resume-step only applies with --resume; add --resume.")
    if cfg.resume_step is not None and cfg.resume_step < 1:
        raise MpmdError(f"--resume-step={cfg.resume_step} must be >= 1 (a saved step).")
    if cfg.no_compile_cache and cfg.compile_cache is not None:
        raise MpmdError(
            f"--compile-cache={cfg.compile_cache} and --no-compile-cache contradict each "
            "other; keep one of them."
        )
    return cfg


def _given_tokenizer(argv: list[str]) -> str | None:
    """The ``--tokenizer`` this invocation gives: on the command line, else in ``--config``."""
    parser = build_parser()
    given = parser.parse_args(argv)
    if given.tokenizer is not None or given.config is None:
        return given.tokenizer
    return read_config_file(given.config, config_keys(parser)).get("tokenizer")


def _saved_config_path(cfg: argparse.Namespace) -> pathlib.Path | None:
    """The saved ``config.toml`` of the run ``--resume`` continues (None: no such run yet;
    `run` says so)."""
    from nnx_mpmd.errors import MpmdError

    try:
        return resolve_run_dir(cfg) / CONFIG_FILE
    except MpmdError:
        return None


def set_cpu_devices(count: int) -> None:
    """Asks XLA for ``count`` CPU devices unless XLA_FLAGS sets a count (before JAX starts).

    Example:
      >>> set_cpu_devices(8)
      >>> "device_count" in os.environ["XLA_FLAGS"]
      True
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()


def train_config_values(cfg: argparse.Namespace) -> dict[str, Any]:
    """`resolved_config` of ``nnx-mpmd train``'s options (`build_parser`).

    Example:
      >>> train_config_values(config_from_args(["--batch-size", "16"]))["batch_size"]
      16
    """
    return resolved_config(cfg, config_keys(build_parser()))
