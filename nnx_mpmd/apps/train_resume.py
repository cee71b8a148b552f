"""The checkpoints of ``nnx-mpmd train``: what each saves, and how ``--resume`` continues.

Every checkpoint holds the model and the optimizer, and as metadata the data
position, the run's settings (`run_settings`) and its tokenizer. A resumed run
(`restore_or_start`) checks that the saved settings fit it: the parameters'
shapes (`STRUCTURE_KEYS`) and the tokenizer never change; settings that change
the numbers (`ARITHMETIC_KEYS`) need ``--allow-changed-settings``; the pipeline
layout (`LAYOUT_KEYS`) may change and the log says so. The functions take the
`nnx_mpmd.apps.train_loop.Trainer`, whose methods of the same names call them.
"""

from __future__ import annotations

import pathlib
from typing import Any

from nnx_mpmd.apps.validate_args import checked_metadata
from nnx_mpmd.checkpoint import CheckpointManager
from nnx_mpmd.errors import CheckpointError

__all__ = [
    "ARITHMETIC_KEYS",
    "LAYOUT_KEYS",
    "RESUME_KEYS",
    "STRUCTURE_KEYS",
    "check_resumable",
    "restore_or_start",
    "run_settings",
    "save_checkpoint",
]

#: Settings that fix the parameters' shapes: a resumed run can never change them.
STRUCTURE_KEYS = ("model", "preset", "layers")
STRUCTURE_KEYS += ("param_dtype",)  # --- precision (issue 48): the stored arrays' dtype ---
#: Settings that change the numbers a resumed run computes: changing one needs
#: ``--allow-changed-settings``.
ARITHMETIC_KEYS = ("lr", "warmup", "steps", "batch_size", "seq_len", "seed", "corpus_bytes")
ARITHMETIC_KEYS += ("dtype",)  # --- precision (issue 48) ---
#: Settings that must equal the checkpoint's for a resumed run to continue it as is.
RESUME_KEYS = STRUCTURE_KEYS + ARITHMETIC_KEYS
#: Settings of the pipeline layout: they may change on resume (same numbers up to
#: float rounding), and the log says which did.
LAYOUT_KEYS = ("schedule", "meshes", "data", "stages", "microbatches", "scan_layers")


def run_settings(trainer: Any) -> dict[str, Any]:
    """The JSON settings of ``trainer``'s run saved in checkpoint metadata (`RESUME_KEYS`, ...)."""
    cfg = trainer.cfg
    return {
        "model": cfg.model,
        "preset": cfg.preset,
        "layers": trainer.num_layers,
        "scan_layers": bool(getattr(cfg, "scan_layers", False)),
        "seq_len": trainer.seq_len,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "corpus_bytes": cfg.corpus_bytes,
        "schedule": cfg.schedule,
        "meshes": cfg.meshes,
        "data": cfg.data,
        "stages": trainer.num_stages,
        "microbatches": cfg.microbatches,
        "steps": cfg.steps,
        "lr": cfg.lr,
        "warmup": cfg.warmup,
        "dtype": trainer.precision.compute_dtype.name,
        "param_dtype": trainer.precision.param_dtype.name,
        "model_config": trainer.model.config.to_dict(),
    }


def save_checkpoint(trainer: Any, manager: CheckpointManager, step: int) -> None:
    """Saves checkpoint ``step``: the model, the optimizer and the metadata a resume reads."""
    manager.save(
        step,
        {"model": trainer.model, "optimizer": trainer.optimizer},
        {
            "step": step,
            "data": trainer.batches.state_dict(),
            "config": run_settings(trainer),
            "tokenizer": trainer.tokenizer.to_dict(),
        },
    )


def _tokenizer_change(saved: dict[str, Any], tokenizer: Any) -> str | None:
    """What differs between the saved tokenizer and this run's, or None."""
    saved_tokenizer = saved.get("tokenizer")
    mine = tokenizer.to_dict()
    if saved_tokenizer == mine:
        return None
    kinds: dict[Any, str] = {"char": "the characters of the corpus", "hf": "a tokenizer file"}
    kinds["sentencepiece"] = "a tokenizer file"
    before = saved_tokenizer.get("type") if isinstance(saved_tokenizer, dict) else None
    if before == mine.get("type") == "char":
        return "the character vocabulary differs (another corpus, --dataset or Python)"
    return (
        f"the tokenizer differs (saved: {kinds.get(before, before)}"
        f"{_file_of(saved_tokenizer)}; now: {kinds.get(mine.get('type'))}{_file_of(mine)}; "
        "resume without --tokenizer to reuse the run's copy)"
    )


def _file_of(description: Any) -> str:
    if isinstance(description, dict) and description.get("file"):
        return f" {description['file']} sha256 {str(description.get('sha256'))[:12]}"
    return ""


def check_resumable(trainer: Any, saved: dict[str, Any], where: pathlib.Path) -> bool:
    """Whether an `ARITHMETIC_KEYS` setting differs (then only the data position is kept).

    Accepted changes are noted in ``trainer.notes``.

    Raises:
      CheckpointError: the parameters' shapes or the tokenizer differ, or an
        arithmetic setting differs without ``--allow-changed-settings``.
    """
    mine = run_settings(trainer)
    config = dict(saved.get("config", {}))
    if config.get("layers") is None:  # older checkpoints saved None for the preset's
        config["layers"] = config.get("model_config", {}).get("n_layers")
    config.setdefault("scan_layers", False)  # saved before --scan-layers existed
    config.setdefault("dtype", "float32")  # saved before --dtype existed
    config.setdefault("param_dtype", "float32")

    def changes(keys: tuple[str, ...]) -> list[str]:
        return [
            f"{key}: saved {config.get(key)!r}, now {mine[key]!r}"
            for key in keys
            if config.get(key) != mine[key]
        ]

    structure = changes(STRUCTURE_KEYS)
    tokenizer_change = _tokenizer_change(saved, trainer.tokenizer)
    if tokenizer_change is not None:
        structure.append(tokenizer_change)
    if structure:
        raise CheckpointError(
            f"the checkpoint in {where} does not fit this run ({'; '.join(structure)}): "
            "the parameters would not match; resume with the saved --model, --preset, "
            "--layers, --param-dtype, --corpus-bytes and --tokenizer, or start a new --run-dir."
        )
    arithmetic = changes(ARITHMETIC_KEYS)
    if arithmetic and not getattr(trainer.cfg, "allow_changed_settings", False):
        raise CheckpointError(
            f"the checkpoint in {where} does not fit this run: settings that change its "
            f"numbers differ ({'; '.join(arithmetic)}); resume with the saved values, pass "
            "--allow-changed-settings to continue with the new ones, or start a new "
            "--run-dir."
        )
    since = f"since the checkpoint of step {saved.get('step')}"
    if arithmetic:
        trainer.notes.append(f"settings changed {since} (accepted): {'; '.join(arithmetic)}")
    layout = changes(LAYOUT_KEYS)
    if layout:
        trainer.notes.append(f"layout changed {since}: {'; '.join(layout)}")
    return bool(arithmetic)


def restore_or_start(trainer: Any, manager: CheckpointManager | None) -> None:
    """Resumes the newest intact checkpoint (``--resume[-step]``) or checks the run dir is fresh.

    Damaged newer steps are skipped with a warning; sets ``trainer.start_step``.

    Raises:
      CheckpointError: a new run in a directory with checkpoints, ``--resume``
        without one, or a checkpoint that does not fit (`check_resumable`).
    """
    where = trainer.run_dir / "checkpoints"
    latest = manager.latest_step() if manager is not None else None
    if not trainer.cfg.resume:
        if latest is not None:
            raise CheckpointError(
                f"{where} already holds checkpoints (latest step {latest}); pass --resume "
                "to continue that run, or choose a new --run-dir."
            )
        return
    if latest is None or manager is None:  # no manager: no checkpoint either
        raise CheckpointError(
            f"--resume: no finished checkpoint in {where}; run without --resume to "
            "start, or point --run-dir at a run that saved one."
        )
    changed: list[bool] = []
    notes_before = len(trainer.notes)

    def check(step: int, saved: dict[str, Any]) -> None:
        del trainer.notes[notes_before:]  # keep the notes of the step restored only
        changed.append(check_resumable(trainer, checked_metadata(saved, where, step), where))

    restored = manager.restore_newest_intact(
        {"model": trainer.model, "optimizer": trainer.optimizer},
        before=getattr(trainer.cfg, "resume_step", None),
        check=check,
    )
    _set_aside_later_steps(trainer, manager, restored)
    saved = restored.metadata
    # Accepted changes (seed, batch size, ...) keep only the saved data position.
    data = {"position": saved["data"]["position"]} if changed[-1] else saved["data"]
    trainer.batches.load_state_dict(data)
    trainer.start_step = int(saved["step"])


def _set_aside_later_steps(trainer: Any, manager: CheckpointManager, restored: Any) -> None:
    """Warns about skipped steps and renames every step after the resumed one, so the
    resumed run saves those step numbers afresh (the old files stay for inspection)."""
    trainer.notes.extend(f"warning: {line}" for line in restored.skipped)
    later = [s for s in manager.all_steps() if s > restored.step]
    if later:
        moved = manager.set_aside(later)
        trainer.notes.append(
            f"resuming from step {restored.step}: set aside later steps {later} as "
            f"{', '.join(p.name for p in moved)}"
        )
