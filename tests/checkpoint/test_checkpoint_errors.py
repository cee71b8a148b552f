"""Every CheckpointError path of save / restore / CheckpointManager."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_helpers import Net, make_optimizer
from flax import nnx

from nnx_mpmd import CheckpointDamagedError, CheckpointError
from nnx_mpmd.checkpoint import CheckpointManager, restore, save
from nnx_mpmd.checkpoint.file_checksums import RECORD
from nnx_mpmd.checkpoint.manifest import json_digest

STAGES = (0, 0, 1, 1)


@pytest.fixture
def saved(tmp_path) -> Path:
    path = tmp_path / "c"
    save(path, {"w": jnp.arange(4000.0), "v": jnp.ones(7), "step": 3})
    return path


def target() -> dict:
    return {"w": jnp.zeros(4000), "v": jnp.zeros(7), "step": 0}


def data_files(path: Path) -> list[Path]:
    files = [p for p in (path / "arrays").rglob("d/*") if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def edit_manifest(path: Path, edit) -> None:
    file = path / "manifest" / "metadata"
    manifest = json.loads(file.read_text())
    edit(manifest)
    file.write_text(json.dumps(manifest))


class Opaque:
    pass


@pytest.mark.parametrize(
    "tree, match",
    [
        ({"x": Opaque()}, r"leaf 'x' has unsupported type Opaque"),
        ({"a.b": jnp.zeros(1), "a": {"b": jnp.zeros(1)}}, r"both map to the logical path 'a\.b'"),
    ],
)
def test_save_rejects_unsavable_trees(tmp_path, tree, match):
    with pytest.raises(CheckpointError, match=match):
        save(tmp_path / "c", tree)
    assert not (tmp_path / "c").exists()


def test_save_refuses_to_overwrite(saved):
    with pytest.raises(CheckpointError, match="already exists; pass overwrite=True"):
        save(saved, {"w": jnp.zeros(2)})
    save(saved, {"w": jnp.zeros(2)}, overwrite=True)
    assert restore(saved, {"w": jnp.ones(2)})["w"].tolist() == [0.0, 0.0]


def test_restore_missing_checkpoints(tmp_path, saved):
    with pytest.raises(CheckpointError, match="does not exist"):
        restore(tmp_path / "nothing", target())
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no 'manifest' item"):
        restore(tmp_path / "empty", target())
    shutil.copytree(saved, tmp_path / "half.orbax-checkpoint-tmp-123")
    with pytest.raises(CheckpointError, match=r"only an unfinished save .* interrupted"):
        restore(tmp_path / "half", target())
    (tmp_path / "mgr" / "12").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="looks like a CheckpointManager directory"):
        restore(tmp_path / "mgr", target())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: t.pop("v"), r"checkpoint .* has 'v' but the target does not"),
        (lambda t: t.update(u=jnp.zeros(2)), r"target path 'u' is not in checkpoint"),
        (lambda t: t.update(v=jnp.zeros(8)), r"shape mismatch at 'v': checkpoint .* \[7\]"),
        (lambda t: t.update(v=jnp.zeros(7, jnp.int32)), r"dtype mismatch at 'v'.*'float32'"),
        (lambda t: t.update(v=np.zeros(7, np.float32)), r"kind mismatch at 'v'.*'array'"),
        (lambda t: t.update(step=0.0), r"type mismatch at 'step'.*'int'.*'float'"),
    ],
)
def test_restore_rejects_mismatching_targets(saved, change, match):
    wanted = target()
    change(wanted)
    before = np.asarray(wanted["w"])
    with pytest.raises(CheckpointError, match=match):
        restore(saved, wanted)
    np.testing.assert_array_equal(np.asarray(wanted["w"]), before)


def test_first_mismatching_path_is_named_and_model_untouched(tmp_path):
    model = Net(STAGES, seed=1)
    save(tmp_path / "c", {"model": model})
    wider = Net(STAGES, seed=2)
    wider.blocks[2].module.linear.kernel.set_value(jnp.zeros((8, 9)))
    wider.blocks[3].module.linear.kernel.set_value(jnp.zeros((8, 9)))
    untouched = np.asarray(wider.head.module.kernel[...])
    with pytest.raises(
        CheckpointError, match=r"shape mismatch at 'model\.blocks\.2\.linear\.kernel'"
    ):
        restore(tmp_path / "c", {"model": wider})
    np.testing.assert_array_equal(wider.head.module.kernel[...], untouched)


def test_key_impl_mismatch(tmp_path):
    save(tmp_path / "c", {"rngs": nnx.Rngs(jax.random.key(0, impl="rbg"))})
    with pytest.raises(CheckpointError, match=r"impl mismatch at 'rngs\.default\.key'.*'rbg'"):
        restore(tmp_path / "c", {"rngs": nnx.Rngs(0)})


def test_optimizer_without_model_does_not_restore_into_plain_layout(tmp_path):
    save(tmp_path / "c", {"optimizer": make_optimizer(Net(STAGES))})
    with pytest.raises(CheckpointError, match=r"opt_state\.0\.mu\.blocks\.0\.linear\.bias"):
        restore(tmp_path / "c", {"optimizer": make_optimizer(Net(None))})


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_array_files(saved, damage):
    for file in data_files(saved):
        if damage == "truncate":
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 3])
        else:
            file.unlink()
    what = "bytes, .* were written" if damage == "truncate" else "is missing"
    with pytest.raises(CheckpointDamagedError, match=rf"c/arrays is corrupted: its file .*{what}"):
        restore(saved, target())  # the file record, before orbax reads
    (saved / RECORD).unlink()  # no record (an older save): orbax's read fails
    with pytest.raises(CheckpointError, match=r"cannot be read at 'v'.*truncated or corrupted"):
        restore(saved, target())


def test_corrupted_contents_fail_the_checksum(saved):
    def wrong_checksum(manifest):
        manifest["entries"]["w"]["checksum"][0] ^= 1
        manifest["seal"] = json_digest({k: v for k, v in manifest.items() if k != "seal"})

    edit_manifest(saved, wrong_checksum)  # a consistent manifest, other contents
    (saved / RECORD).unlink()  # the file record would name the changed manifest file
    with pytest.raises(CheckpointDamagedError, match=r"arrays is corrupted at 'w'.*checksum"):
        restore(saved, target())
    assert restore(saved, target(), verify=False)["w"][5] == 5.0


def test_edited_manifest_breaks_its_seal(saved):
    edit_manifest(saved, lambda m: m["entries"]["step"].__setitem__("value", 4))
    with pytest.raises(CheckpointDamagedError, match=r"c/manifest was changed after it was saved"):
        restore(saved, target())


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(format="other"), "no valid nnx_mpmd manifest"),
        (lambda m: m.update(version=99), "manifest version 99"),
    ],
)
def test_foreign_manifests(saved, edit, match):
    edit_manifest(saved, edit)
    with pytest.raises(CheckpointError, match=match):
        restore(saved, target())


def test_unreadable_manifest(saved):
    (saved / "manifest" / "metadata").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"unreadable manifest .* truncated or corrupted"):
        restore(saved, target())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_to_keep": 0}, "max_to_keep=0 must be >= 1"),
        ({"save_interval_steps": 0}, "save_interval_steps=0 must be >= 1"),
    ],
)
def test_manager_options(tmp_path, kwargs, match):
    with pytest.raises(CheckpointError, match=match):
        CheckpointManager(tmp_path, **kwargs)


@pytest.mark.parametrize(
    "step, metadata, match",
    [
        (-1, None, "step=-1 must be an int >= 0"),
        (1.5, None, r"step=1\.5 must be an int"),
        (1, [1, 2], "metadata must be a dict, got list"),
        (1, {"x": object()}, "metadata is not JSON-serializable"),
        (0, None, "step 0 already exists"),
    ],
)
def test_manager_save_errors(tmp_path, step, metadata, match):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(0, {"w": jnp.zeros(2)})
        with pytest.raises(CheckpointError, match=match):
            mgr.save(step, {"w": jnp.zeros(2)}, metadata=metadata)


def test_manager_restore_errors(tmp_path):
    with CheckpointManager(tmp_path / "m", async_save=False) as mgr:
        with pytest.raises(CheckpointError, match=r"no checkpoint in .* \(no finished step\)"):
            mgr.restore({"w": jnp.zeros(2)})
        with pytest.raises(CheckpointError, match="no checkpoint in"):
            mgr.metadata()
        mgr.save(1, {"w": jnp.zeros(2)})
        with pytest.raises(CheckpointError, match=r"step 2 is not in .* available steps: \[1\]"):
            mgr.restore({"w": jnp.zeros(2)}, step=2)
        with pytest.raises(CheckpointError, match=r"shape mismatch at 'w'"):
            mgr.restore({"w": jnp.zeros(3)})
    manifest = tmp_path / "m" / "1" / "manifest" / "metadata"
    intact = manifest.read_text()
    manifest.write_text("[")
    with (
        CheckpointManager(tmp_path / "m", async_save=False) as mgr,
        pytest.raises(CheckpointError, match="unreadable manifest"),
    ):
        mgr.restore({"w": jnp.zeros(2)})
    manifest.write_text(intact)
    (tmp_path / "m" / "1" / "metadata" / "metadata").write_text("[")
    with (
        CheckpointManager(tmp_path / "m", async_save=False) as mgr,
        pytest.raises(CheckpointError, match="unreadable metadata"),
    ):
        mgr.metadata(1)
