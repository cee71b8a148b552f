"""``nnx-mpmd convert``: Hugging Face model directories <-> run directories.

Two directions::

    nnx-mpmd convert --from-hf DIR --run-dir R [-- TRAIN-OPTIONS]
    nnx-mpmd convert --run-dir R [--step N] --to-hf DIR

``--from-hf`` turns a Hugging Face directory (``config.json`` +
``model.safetensors`` [+ ``tokenizer.json``], GPT-2 or Llama) into a run
directory with a checkpoint of step 0, as ``nnx-mpmd train --init-from DIR``
would have started it: ``nnx-mpmd generate --run-dir R`` samples from it and
``nnx-mpmd train --resume --run-dir R`` fine-tunes it. Options after ``--`` are
``nnx-mpmd train`` options (``--steps``, ``--lr``, ``--batch-size``, ...) saved
with the checkpoint and in ``R/config.toml``, which ``--resume`` reads back. ``--to-hf`` writes a
run's checkpoint (the latest, or ``--step N``) as a Hugging Face directory that
``transformers`` loads; a run that started from a Hugging Face directory also
gets its ``tokenizer.json`` back.

The ``train`` side (``--init-from``: `apply_init_from`, `pretrained_model`,
`keep_pretrained_config`) lives in `nnx_mpmd.apps.pretrained`, which the trainer
imports without this command; this module re-exports it.

Bad input (a missing file, an architecture the zoo lacks, a tokenizer larger
than the checkpoint's vocabulary, a run without checkpoints) prints one line
and exits with 2, leaving no files behind.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

# The train side (``--init-from``) lives in nnx_mpmd.apps.pretrained; its names stay importable here.
from nnx_mpmd.apps.pretrained import (
    PRETRAINED_DIR,
    apply_init_from,
    keep_pretrained_config,
    pretrained_max_len,
    pretrained_model,
)

__all__ = [
    "PRETRAINED_DIR",
    "apply_init_from",
    "build_parser",
    "export_run",
    "import_hf",
    "keep_pretrained_config",
    "main",
    "pretrained_max_len",
    "pretrained_model",
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nnx-mpmd convert``.

    Example:
      >>> build_parser().parse_args(["--run-dir", "r", "--to-hf", "out"]).to_hf
      'out'
    """
    p = argparse.ArgumentParser(
        prog="nnx-mpmd convert",
        description="Convert a Hugging Face model directory (GPT-2 or Llama: config.json + "
        "model.safetensors) into a run directory that nnx-mpmd generate and nnx-mpmd train "
        "--resume use, or a run's checkpoint into a Hugging Face directory.",
        epilog="examples: nnx-mpmd convert --from-hf hf_model --run-dir runs/ft -- --steps 100; "
        "nnx-mpmd convert --run-dir runs/ft --to-hf exported",
    )
    p.add_argument("--from-hf", metavar="DIR", default=None, help="Hugging Face dir to import")
    p.add_argument("--to-hf", metavar="DIR", default=None, help="Hugging Face dir to write")
    p.add_argument("--run-dir", metavar="R", required=True, help="the run directory")
    p.add_argument(
        "--step", type=int, default=None, help="with --to-hf: the step to export (default: latest)"
    )
    p.add_argument(
        "train_options",
        nargs="*",
        metavar="-- TRAIN-OPTIONS",
        help="with --from-hf: nnx-mpmd train options saved with the checkpoint",
    )
    return p


# -- the two directions of nnx-mpmd convert -------------------------------------------------


def import_hf(source: pathlib.Path, run_dir: pathlib.Path, train_options: list[str]) -> int:
    """Writes a new run directory whose step-0 checkpoint holds ``source``'s weights.

    Raises:
      MpmdError: bad options, an unsupported or unreadable directory, or a run
        directory that already holds checkpoints.
    """
    from nnx_mpmd.apps.train_args import config_from_args, set_cpu_devices, train_config_values
    from nnx_mpmd.apps.validate_args import check_output_dir
    from nnx_mpmd.errors import CheckpointError

    argv = ["--meshes", "1", "--data", "1", *train_options]
    cfg = config_from_args([*argv, "--init-from", str(source), "--run-dir", str(run_dir)])
    set_cpu_devices(cfg.devices)
    check_output_dir(run_dir, "--run-dir")
    if (run_dir / "checkpoints").exists():
        raise CheckpointError(
            f"--run-dir {run_dir} already holds checkpoints/; choose a new run directory."
        )
    apply_init_from(cfg, run_dir)
    from nnx_mpmd.apps.train_config import write_run_config
    from nnx_mpmd.apps.train_loop import Trainer
    from nnx_mpmd.checkpoint import CheckpointManager
    from nnx_mpmd.models import count_params

    trainer = Trainer(cfg, run_dir)  # checks everything before a file is written
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        keep_pretrained_config(source, run_dir)
        manager = CheckpointManager(run_dir / "checkpoints", max_to_keep=cfg.keep)
        try:
            trainer.save_checkpoint(manager, 0)
        finally:
            manager.close()
        # `nnx-mpmd train --resume --run-dir R` reads the options back from R/config.toml.
        write_run_config(run_dir, train_config_values(cfg))
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return count_params(trainer.model)


def export_run(run_dir: pathlib.Path, step: int | None, out: pathlib.Path) -> int:
    """Writes checkpoint ``step`` (None: the latest) as a Hugging Face directory; returns the step.

    Raises:
      MpmdError: no checkpoint, a checkpoint without the model's configuration,
        or a model the Hugging Face layout lacks.
    """
    from flax import nnx

    from nnx_mpmd.apps.validate_args import check_output_dir
    from nnx_mpmd.checkpoint import CheckpointManager
    from nnx_mpmd.errors import CheckpointError
    from nnx_mpmd.models import MODELS, save_pretrained

    where = run_dir / "checkpoints"
    if not where.is_dir():
        raise CheckpointError(
            f"--run-dir {run_dir} holds no checkpoints/; point it at a run that saved one."
        )
    check_output_dir(out, "--to-hf")
    manager = CheckpointManager(where)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{where} holds no finished checkpoint to export.")
        config = manager.metadata(step).get("config", {})
        family, fields = config.get("model"), config.get("model_config")
        if family not in MODELS or not isinstance(fields, dict):
            raise CheckpointError(
                f"the metadata of checkpoint {step} in {where} does not name the model "
                "(config.model and config.model_config); was it written by nnx-mpmd train?"
            )
        model_cls, config_cls = MODELS[family]
        fields = {**fields, "num_stages": 1, "scan_layers": False}
        model = model_cls(config_cls.from_dict(fields), rngs=nnx.Rngs(0))
        manager.restore({"model": model}, step, partial=True)
    finally:
        manager.close()
    save_pretrained(model, out)
    tokenizer = run_dir / PRETRAINED_DIR / "tokenizer.json"
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    return step


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnx-mpmd convert``: 0 on success, 2 on bad input.

    Example:
      >>> main(["--run-dir", "r"])
      2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from nnx_mpmd.errors import MpmdError

    if (args.from_hf is None) == (args.to_hf is None):
        return _fail("give exactly one of --from-hf DIR and --to-hf DIR (with --run-dir R)")
    if args.from_hf is None and args.train_options:
        return _fail(f"train options {args.train_options} only apply with --from-hf")
    if args.from_hf is not None and args.step is not None:
        return _fail("--step only applies with --to-hf (the imported checkpoint is step 0)")
    run_dir = pathlib.Path(args.run_dir)
    try:
        if args.from_hf is not None:
            count = import_hf(pathlib.Path(args.from_hf), run_dir, args.train_options)
            print(
                f"converted {args.from_hf} ({count:,} parameters) into {run_dir}/checkpoints "
                f"step 0; fine-tune with: nnx-mpmd train --resume --run-dir {run_dir}"
            )
        else:
            step = export_run(run_dir, args.step, pathlib.Path(args.to_hf))
            print(
                f"wrote step {step} of {run_dir} to {args.to_hf} (config.json, model.safetensors)"
            )
    except MpmdError as e:
        return _fail(f"{type(e).__name__}: {e}")
    return 0


def _fail(message: str) -> int:
    print(f"nnx-mpmd convert: error: {message}", file=sys.stderr)
    return 2
