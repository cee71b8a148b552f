"""Damaged checkpoints and faults while saving: each is refused, fallen back from, or reported.

* Contents: the CRC-32 of every file as stored (a flipped byte in any file),
  a checksum per array (two negated elements of equal parity, which the old
  wrapping sums missed), another step's arrays copied in, an edited manifest,
  metadata or file record, a manifest of another step: `CheckpointDamagedError`
  naming the path.
* Stray and partial steps (an empty step directory, a half-copied one, one
  without orbax's commit marker) make `CheckpointManager.restore_newest_intact`
  and ``nnx-mpmd train --resume`` fall back to the newest intact step with a
  warning naming the step skipped; ``--resume-step N`` chooses one.
* A permission problem is reported as one, never as damage, and never skipped.
* A full disk during an asynchronous save ends in one `CheckpointError` naming
  the step directory and the free space; the earlier steps stay intact and
  ``--resume`` continues from them equal to a straight run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from mp_launch import logged_losses, train_env

from nnx_mpmd import CheckpointDamagedError, CheckpointError
from nnx_mpmd.checkpoint import CheckpointManager, restore, save
from nnx_mpmd.checkpoint.file_checksums import RECORD

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parents[1] / "mp_scripts"
TIMEOUT_S = 300  # bounds a hang, not the happy path on a loaded machine

W = jnp.arange(1.0, 4001.0)
# Negating two elements of equal parity leaves both old wrapping sums unchanged.
W_FLIPPED = W.at[10].set(-W[10]).at[12].set(-W[12])


def target() -> dict:
    return {"w": jnp.zeros(4000), "step": 0}


def manager_with_steps(directory: Path, steps=(1, 2)) -> CheckpointManager:
    manager = CheckpointManager(directory, async_save=False)
    for step in steps:
        manager.save(step, {"w": W * step, "step": step}, {"step": step, "lr": 0.1})
    return manager


def data_files(path: Path) -> list[Path]:
    files = [p for p in (path / "arrays").rglob("d/*") if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


# -- contents -------------------------------------------------------------------------


def test_equal_parity_negation_is_refused(tmp_path):
    save(tmp_path / "good", {"w": W, "step": 3})
    save(tmp_path / "flipped", {"w": W_FLIPPED, "step": 3})
    # The files as stored change; the manifest is the original one.
    shutil.rmtree(tmp_path / "good" / "arrays")
    shutil.copytree(tmp_path / "flipped" / "arrays", tmp_path / "good" / "arrays")
    with pytest.raises(CheckpointDamagedError, match=r"good/arrays is corrupted: its file "):
        restore(tmp_path / "good", target())  # the files' CRC-32s
    (tmp_path / "good" / RECORD).unlink()  # no record (an older save): the value checksums
    with pytest.raises(CheckpointDamagedError, match=r"good/arrays is corrupted at 'w'"):
        restore(tmp_path / "good", target())


def _flip_byte(file: Path) -> bytes:
    original = file.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    return original


def test_a_flipped_byte_in_any_file_is_named_before_reading(tmp_path):
    manager = manager_with_steps(tmp_path)
    step = tmp_path / "2"
    files = sorted(p for p in step.rglob("*") if p.is_file() and p.name != RECORD)
    assert any("/arrays/" in str(p) for p in files) and len(files) > 5, files
    for file in files:
        original = _flip_byte(file)
        item = file.relative_to(step).parts[0]
        with pytest.raises(CheckpointDamagedError) as raised:
            manager.restore(target(), step=2)
        message = str(raised.value)
        if file.parent.name not in ("manifest", "metadata") or item != file.parent.name:
            # The JSON items fail their own seals first; every other file is named.
            assert f"{step}/{item} is corrupted: its file {file} was changed" in message, message
        restored = manager.restore_newest_intact(target())
        assert restored.step == 1 and restored.skipped[0].startswith("skipped step 2: ")
        file.write_bytes(original)
    np.testing.assert_array_equal(restored_w(manager, 2), W * 2)  # intact again
    manager.close()


def test_the_file_record_is_sealed_and_tied_to_its_step(tmp_path):
    manager = manager_with_steps(tmp_path)
    record = tmp_path / "2" / RECORD
    original = record.read_text()
    record.write_text(original.replace('"crc32": ', '"crc32": 1', 1))
    with pytest.raises(CheckpointDamagedError, match=r"/2/file_checksums.json was changed after"):
        manager.restore(target(), step=2)
    shutil.copy(tmp_path / "1" / RECORD, record)
    with pytest.raises(CheckpointDamagedError, match=r"/2/file_checksums.json belongs to another"):
        manager.restore(target(), step=2)
    record.write_text(original)
    (tmp_path / "2" / "arrays" / "_METADATA").unlink()
    with pytest.raises(CheckpointDamagedError, match=r"/2/arrays/_METADATA is missing"):
        manager.restore(target(), step=2)
    manager.close()


def test_checksum_detects_single_bit_and_swaps():
    from nnx_mpmd.checkpoint.manifest import checksum

    def sums(x):
        return [int(v) for v in checksum(x)]

    base = sums(W)
    assert sums(W_FLIPPED) != base
    assert sums(W.at[0].set(W[1]).at[1].set(W[0])) != base  # two elements swapped
    assert sums(jax.lax.bitcast_convert_type(W, jnp.int32).at[7].add(1)) != sums(
        jax.lax.bitcast_convert_type(W, jnp.int32)
    )
    # Independent of the sharding: the same on a sharded copy.
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    sharded = jax.device_put(W, jax.NamedSharding(mesh, jax.P("x")))
    assert sums(sharded) == base


def test_another_steps_arrays_copied_in_are_refused(tmp_path):
    manager = manager_with_steps(tmp_path)
    shutil.rmtree(tmp_path / "2" / "arrays")
    shutil.copytree(tmp_path / "1" / "arrays", tmp_path / "2" / "arrays")
    with pytest.raises(
        CheckpointDamagedError, match=r"/2/arrays is corrupted: its file \S+/2/arrays/\S+ (has|was)"
    ):
        manager.restore(target(), step=2)
    restored = manager.restore_newest_intact(target())
    assert restored.step == 1 and "skipped step 2" in restored.skipped[0]
    manager.close()


def test_another_steps_manifest_copied_in_is_refused(tmp_path):
    manager = manager_with_steps(tmp_path)
    for item in ("arrays", "manifest", "metadata"):
        shutil.rmtree(tmp_path / "2" / item)
        shutil.copytree(tmp_path / "1" / item, tmp_path / "2" / item)
    with pytest.raises(CheckpointDamagedError, match=r"/2/manifest belongs to step 1, not to"):
        manager.restore(target(), step=2)
    manager.close()


def test_edited_metadata_is_refused(tmp_path):
    manager = manager_with_steps(tmp_path)
    file = tmp_path / "2" / "metadata" / "metadata"
    file.write_text(json.dumps({**json.loads(file.read_text()), "lr": 0.2}))
    with pytest.raises(CheckpointDamagedError, match=r"/2/metadata does not match the SHA-256"):
        manager.metadata(2)
    restored = manager.restore_newest_intact(target())
    assert restored.step == 1 and restored.metadata == {"step": 1, "lr": 0.1}
    assert restored.skipped[0].startswith("skipped step 2: ")
    manager.close()


# -- stray and partial steps ----------------------------------------------------------


def _empty_step(directory: Path) -> None:
    (directory / "5").mkdir()


def _half_copied_step(directory: Path) -> None:
    shutil.copytree(directory / "2", directory / "5", ignore=shutil.ignore_patterns("d"))


def _no_commit_marker(directory: Path) -> None:
    (directory / "2" / "commit_success.txt").unlink()


def _truncated_arrays(directory: Path) -> None:
    file = data_files(directory / "2")[0]
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 3])


@pytest.mark.parametrize(
    "damage, skipped, restored_step, reason",
    [
        (_empty_step, 5, 2, r"/5 is incomplete: it has no commit_success.txt and no manifest"),
        (_half_copied_step, 5, 2, r"/5/manifest belongs to step 2, not to step 5"),
        (_no_commit_marker, 2, 1, r"/2 is incomplete: it has no commit_success.txt"),
        (_truncated_arrays, 2, 1, r"/2/arrays is corrupted: its file .* bytes, \d+ were written"),
    ],
)
def test_damaged_latest_step_falls_back(tmp_path, damage, skipped, restored_step, reason):
    manager_with_steps(tmp_path, steps=(1, 2)).close()
    damage(tmp_path)
    manager = CheckpointManager(tmp_path, async_save=False)  # lists a stray step too
    restored = manager.restore_newest_intact(target())
    assert restored.step == restored_step
    np.testing.assert_array_equal(restored_w(manager, restored_step), W * restored_step)
    assert len(restored.skipped) == 1, restored.skipped
    assert restored.skipped[0].startswith(f"skipped step {skipped}: checkpoint ")
    assert re.search(reason, restored.skipped[0]), restored.skipped[0]
    with pytest.raises(CheckpointDamagedError, match=reason):
        manager.restore(target(), step=skipped)
    manager.close()


def restored_w(manager: CheckpointManager, step: int) -> np.ndarray:
    return np.asarray(manager.restore(target(), step=step)["w"])


def test_no_intact_step_lists_every_skipped_one(tmp_path):
    manager = manager_with_steps(tmp_path, steps=(1,))
    (tmp_path / "1" / "commit_success.txt").unlink()
    with pytest.raises(CheckpointDamagedError, match=r"no intact checkpoint in .*skipped step 1"):
        manager.restore_newest_intact(target())
    manager.close()


def test_set_aside_frees_the_step_numbers(tmp_path):
    manager = manager_with_steps(tmp_path, steps=(1, 2))
    moved = manager.set_aside([2])
    assert [p.name for p in moved] == ["2.set-aside"] and manager.all_steps() == [1]
    manager.save(2, {"w": W, "step": 2}, {"step": 2, "lr": 0.1})
    assert manager.all_steps() == [1, 2] and (tmp_path / "2.set-aside" / "manifest").is_dir()
    manager.close()


# -- permissions ----------------------------------------------------------------------


def test_unreadable_step_directory_is_a_permission_problem(tmp_path, monkeypatch):
    manager = manager_with_steps(tmp_path)
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: Path(p).name != "2" and real_access(p, mode)
    )  # as root, chmod does not keep this process out
    with pytest.raises(CheckpointError, match=r"permission denied reading checkpoint .*/2") as e:
        manager.restore_newest_intact(target())
    assert not isinstance(e.value, CheckpointDamagedError)  # never skipped as damaged
    manager.close()


def test_permission_denied_inside_orbax_is_not_called_damage(tmp_path, monkeypatch):
    manager = manager_with_steps(tmp_path)

    def denied(*args, **kwargs):
        raise ValueError(
            f'PERMISSION_DENIED: Error opening "{tmp_path}/2/arrays/manifest.ocdbt": '
            "Permission denied [OS error: Permission denied]"
        )

    monkeypatch.setattr(ocp.CheckpointManager, "restore", denied)
    with pytest.raises(CheckpointError, match=r"permission denied reading checkpoint .*/2 ") as e:
        manager.metadata(2)
    assert "truncated" not in str(e.value) and "damaged" not in str(e.value)
    manager.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files of any mode")
def test_chmod_000_step_is_a_permission_problem(tmp_path):
    manager = manager_with_steps(tmp_path)
    os.chmod(tmp_path / "2", 0)
    try:
        with pytest.raises(CheckpointError, match=r"permission denied reading checkpoint"):
            manager.restore(target(), step=2)
    finally:
        os.chmod(tmp_path / "2", 0o755)
        manager.close()


# -- a full disk ----------------------------------------------------------------------


def test_file_size_limit_during_async_save_is_one_error(tmp_path):
    directory = tmp_path / "ckpt"
    done = subprocess.run(
        ["timeout", "-k", "5", str(TIMEOUT_S), sys.executable, str(SCRIPTS / "fsize_limit_save.py"),
         str(directory)],
        cwd=ROOT, env=train_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len([line for line in lines if "Error" in line]) == 1, done.stderr[-3000:]
    assert re.search(
        r"saving checkpoint .*ckpt/2\S* failed: a file reached the size limit .* MiB free on "
        r".*steps \[1\] are untouched",
        done.stderr,
    ), done.stderr
    manager = CheckpointManager(directory, async_save=False)
    assert manager.all_steps() == [1]
    step_one = np.arange(60000.0, dtype=np.float32)  # as fsize_limit_save.py saved it
    np.testing.assert_array_equal(manager.restore({"w": jnp.zeros(60000)})["w"], step_one)
    manager.close()


# -- nnx-mpmd train ---------------------------------------------------------------------

TRAIN = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "2", "--keep", "3", "--warmup", "1",
    "--steps", "6", "--devices", "2", "--sample-tokens", "0", "--val-batches", "0",
]  # fmt: skip


def _train(run_dir: Path, *args: str, script: str | None = None, **env: str):
    command = [sys.executable, str(SCRIPTS / script)] if script else [
        sys.executable, "-m", "nnx_mpmd", "train"]  # fmt: skip
    return subprocess.run(
        ["timeout", "-k", "5", str(TIMEOUT_S), *command, *TRAIN, "--run-dir", str(run_dir), *args],
        cwd=ROOT, env=train_env(**env), capture_output=True, text=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    done = _train(run_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return logged_losses(run_dir)


def _assert_continues(run_dir: Path, straight: dict[int, float], steps) -> None:
    losses = logged_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step in steps:  # the same program and data: equal to float rounding
        assert losses[step] == pytest.approx(straight[step], rel=1e-6), step


@pytest.mark.slow  # three short training runs in fresh processes
def test_resume_falls_back_past_damaged_steps(tmp_path, straight_losses):
    run_dir = tmp_path / "run"
    first = _train(run_dir, "--stop-at", "4")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / "4" / "arrays")  # step 2's arrays copied into step 4
    shutil.copytree(checkpoints / "2" / "arrays", checkpoints / "4" / "arrays")
    (checkpoints / "5").mkdir()  # a stray, empty step

    resumed = _train(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    out = resumed.stdout
    assert "warning: skipped step 5: checkpoint" in out and "/5 is incomplete" in out, out
    assert "warning: skipped step 4: checkpoint" in out and "4/arrays is corrupted" in out, out
    assert "resumed from step 2" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "2", "4", "4.set-aside", "5.set-aside", "6"]  # fmt: skip
    _assert_continues(run_dir, straight_losses, range(3, 7))

    chosen = _train(run_dir, "--resume", "--resume-step", "4")
    assert chosen.returncode == 0, chosen.stdout[-3000:] + chosen.stderr[-3000:]
    assert "resumed from step 4" in chosen.stdout and "set aside later steps [6]" in chosen.stdout
    _assert_continues(run_dir, straight_losses, range(5, 7))


@pytest.mark.slow  # two short training runs in fresh processes
def test_disk_full_during_save_stops_with_one_error_and_resumes(tmp_path, straight_losses):
    run_dir = tmp_path / "run"
    full = _train(run_dir, script="disk_full_train.py", NNX_MPMD_TEST_FULL_STEP="4")
    assert full.returncode == 2, full.stdout[-3000:] + full.stderr[-3000:]
    lines = [line for line in full.stderr.splitlines() if line.strip()]
    assert "Traceback" not in full.stderr and len(lines) == 1, full.stderr[-4000:]
    assert re.search(
        r"CheckpointError: saving checkpoint \S*checkpoints/4\S* failed: the disk is full "
        r"\([\d,.]+ MiB free on \S*checkpoints\); steps \[2\] are untouched",
        lines[0],
    ), lines[0]
    resumed = _train(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout
    _assert_continues(run_dir, straight_losses, range(3, 7))


def test_resume_step_needs_resume(tmp_path):
    from nnx_mpmd.apps.train import main

    assert main(["--resume-step", "3", "--run-dir", str(tmp_path / "r")]) == 2


def _as_version_1(path: Path) -> None:
    """Rewrites ``path``'s manifest as nnx_mpmd wrote it before checksums and seals."""
    from nnx_mpmd.checkpoint.manifest import fingerprint

    file = path / "manifest" / "metadata"
    manifest = json.loads(file.read_text())
    for key in ("seal", "step", "metadata_sha256"):
        manifest.pop(key)
    manifest["version"] = 1
    manifest["entries"]["w"].pop("checksum")
    manifest["entries"]["w"]["fingerprint"] = [int(v) for v in fingerprint(W)]
    file.write_text(json.dumps(manifest))
    (path / RECORD).unlink()  # written since


def test_version_1_checkpoints_are_still_read_and_verified(tmp_path):
    save(tmp_path / "old", {"w": W, "step": 3})
    _as_version_1(tmp_path / "old")
    np.testing.assert_array_equal(restore(tmp_path / "old", target())["w"], W)
    save(tmp_path / "other", {"w": W + 1, "step": 3})
    shutil.rmtree(tmp_path / "old" / "arrays")
    shutil.copytree(tmp_path / "other" / "arrays", tmp_path / "old" / "arrays")
    with pytest.raises(
        CheckpointDamagedError, match=r"old/arrays is corrupted at 'w'.*fingerprint"
    ):
        restore(tmp_path / "old", target())


LAUNCHED = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "2", "--keep", "3", "--warmup", "1",
    "--steps", "6", "--sample-tokens", "0", "--val-batches", "0",
]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.slow  # two launches of two processes
def test_launched_resume_falls_back_together(tmp_path):
    from mp_launch import check, launch, launch_cache

    run_dir = tmp_path / "run"
    common = [*LAUNCHED, "--run-dir", str(run_dir), "--compile-cache", launch_cache()]
    command = [sys.executable, "-m", "nnx_mpmd", "train"]
    first, _ = launch(command, *common, "--stop-at", "4", devices_per_process=1, timeout=300,
                      fresh=[(run_dir, False)])  # fmt: skip
    check(first)
    straight = logged_losses(run_dir)
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / "4" / "arrays")  # step 2's arrays (both processes' parts)
    shutil.copytree(checkpoints / "2" / "arrays", checkpoints / "4" / "arrays")
    (checkpoints / "5").mkdir()
    resumed, _ = launch(command, *common, "--resume", devices_per_process=1, timeout=300)
    check(resumed)
    out = resumed.stdout
    assert "warning: skipped step 5" in out and "warning: skipped step 4" in out, out[-3000:]
    assert "4/arrays is corrupted" in out and "resumed from step 2" in out, out[-3000:]
    losses = logged_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4):
        assert losses[step] == pytest.approx(straight[step], rel=1e-6), step
