"""Bad input to the command line ends in one line naming the fix, status 2, and no files.

Issue 47 item 7 (a negative seed, a run directory or compilation cache that is a
file, plan files that are not plans or made for another model, damaged
checkpoint metadata, a launch command that does not exist) and item 8 (a
compilation cache that others can write is refused, and never loaded from).
Each case runs the CLI's ``main`` in this process: nothing here trains.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import types

import jax
import pytest
from flax import nnx

from nnx_mpmd.aot import program_sharing, step_store
from nnx_mpmd.aot.compile_cache import check_cache_dir, enable_compile_cache
from nnx_mpmd.apps import cli, train
from nnx_mpmd.apps.validate_args import check_output_dir, checked_metadata
from nnx_mpmd.errors import CheckpointError, CompileError, MpmdError, PlanError
from nnx_mpmd.planner.plan import Plan
from nnx_mpmd.planner.search import Candidate

# Small enough that the few cases that build the model do so in a second.
SMALL = ["--meshes", "1", "--data", "1", "--batch-size", "4", "--microbatches", "2"]
SMALL += ["--corpus-bytes", "20000", "--steps", "1", "--layers", "2"]

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _train_fails(argv: list[str], capsys) -> str:
    """Runs ``nnx-mpmd train argv``; asserts status 2 and one error line; returns it."""
    status = cli.main(["train", *argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("nnx-mpmd train: error: "), err
    return lines[0]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Runs the test in an empty directory (``runs/`` would go there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_configured_cache():
    """No compilation cache configured (the tests' own is restored afterwards)."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


# ------------------------------------------------------------------ options


@pytest.mark.parametrize("seed", ["-1", str(2**63)])
def test_a_seed_out_of_range_exits_2_and_writes_nothing(seed, in_tmp, capsys):
    line = _train_fails([*SMALL, "--seed", seed], capsys)
    assert re.search(rf"--seed={seed} must lie in \[0, 2\*\*63\)", line)
    assert list(in_tmp.iterdir()) == []


def test_a_run_dir_that_is_a_file_exits_2(in_tmp, capsys):
    (in_tmp / "taken").write_text("x")
    line = _train_fails([*SMALL, "--run-dir", "taken"], capsys)
    assert "--run-dir taken is a file, not a directory; choose another --run-dir" in line
    line = _train_fails([*SMALL, "--run-dir", "taken/run"], capsys)
    assert "--run-dir taken/run: taken is a file, not a directory" in line
    assert sorted(p.name for p in in_tmp.iterdir()) == ["taken"]


@pytest.mark.skipif(IS_ROOT, reason="root may write any directory")
def test_a_run_dir_that_is_not_writable_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(MpmdError, match=r"--run-dir .*locked/run: .*locked is not writable"):
        check_output_dir(locked / "run", "--run-dir")


def test_a_compile_cache_that_is_a_file_exits_2(in_tmp, no_configured_cache, capsys):
    (in_tmp / "cache").write_text("x")
    line = _train_fails([*SMALL, "--run-dir", "run", "--compile-cache", "cache"], capsys)
    assert re.search(r"CompileError: the compilation cache cache is not a directory; pass", line)
    assert sorted(p.name for p in in_tmp.iterdir()) == ["cache"]


# ------------------------------------------------------------------ the compilation cache


def test_a_new_compile_cache_is_private_to_its_owner(tmp_path, no_configured_cache):
    path = enable_compile_cache(tmp_path / "new" / "jax")
    assert path == tmp_path / "new" / "jax"
    assert path.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o770, 0o757])
def test_a_compile_cache_others_can_write_exits_2(mode, in_tmp, no_configured_cache, capsys):
    shared = in_tmp / "shared"
    shared.mkdir()
    shared.chmod(mode)
    line = _train_fails([*SMALL, "--run-dir", "run", "--compile-cache", "shared"], capsys)
    assert "the compilation cache shared is not safe to load programs from" in line
    assert "group or other users may write it" in line
    assert "Run `chmod go-w shared` if you own it" in line
    assert sorted(p.name for p in in_tmp.iterdir()) == ["shared"]


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give the directory to another user")
def test_a_compile_cache_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 54321, 54321)
    with pytest.raises(CompileError, match=r"belongs to user id 54321, not to you \(user id 0\)"):
        check_cache_dir(theirs)


class _Planted:
    """A pickle that makes a directory when loaded: code run by unpickling."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture
def cache_dir(tmp_path):
    """A compilation cache at ``tmp_path / "cache"``, the tests' own restored afterwards."""
    before = jax.config.jax_compilation_cache_dir
    enabled = jax.config.jax_enable_compilation_cache
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_enable_compilation_cache", True)
    yield directory
    jax.config.update("jax_compilation_cache_dir", before)
    jax.config.update("jax_enable_compilation_cache", enabled)


@pytest.mark.parametrize("writable", ["cache", "folder", "entry"])
def test_a_planted_step_is_not_loaded_from_a_cache_others_can_write(
    writable, cache_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(step_store, "ENABLED", True)  # conftest turns the store off
    key = "0" * 64
    folder = cache_dir / "nnx_mpmd_steps"
    folder.mkdir(mode=0o700)
    entry = folder / f"{key}.pkl"
    entry.write_bytes(pickle.dumps(_Planted(tmp_path / "ran")))
    entry.chmod(0o600)
    loose = {"cache": cache_dir, "folder": folder, "entry": entry}[writable]
    mode = loose.stat().st_mode
    loose.chmod(mode | 0o002)
    assert step_store.load_step(key, []) is None
    assert not (tmp_path / "ran").exists()  # the planted code did not run
    loose.chmod(mode)
    step_store.load_step(key, [])  # the control: a private cache is read (and runs it)
    assert (tmp_path / "ran").exists()


def test_a_planted_program_is_not_loaded_from_a_cache_others_can_write(cache_dir, tmp_path):
    key = ("planted",)
    entry = program_sharing._stored_path(key)
    entry.parent.mkdir(mode=0o700)
    entry.write_bytes(pickle.dumps(_Planted(tmp_path / "ran")))
    cache_dir.chmod(0o777)
    assert program_sharing.recall(key) is None
    assert not (tmp_path / "ran").exists()
    cache_dir.chmod(0o700)
    program_sharing.recall(key)
    assert (tmp_path / "ran").exists()


# ------------------------------------------------------------------ plans


def _plan_file(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "plan.json"
    path.write_text(text)
    return str(path)


def _plan_json(**changes) -> str:
    best = Candidate("gpipe", 1, 2, (0, 0, 0, 0), (False,), 0.1, (1,))
    paths = ("embed", "blocks.0", "blocks.1", "head")
    data = json.loads(Plan(best, (), paths, 1, 4).to_json())
    data["model"] = "GPT"
    for key, value in changes.items():
        target = data["best"] if key in best.to_dict() else data
        target[key] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json {", r"cannot read a plan \(not JSON: Expecting value"),
        ("{}", r"cannot read a plan \(no 'best' configuration\)"),
        ("[1, 2]", r"cannot read a plan \(no 'best' configuration\)"),
        (_plan_json(best=[]), r"cannot read a plan \(no 'best' configuration\)"),
        (_plan_json(num_stages="1"), r"num_stages missing or of the wrong type"),
        (_plan_json(batch_size=4.5), r"batch_size missing or of the wrong type"),
        (_plan_json(schedule=3), r"schedule \(a name\) missing or of the wrong type"),
        (_plan_json(unit_stages=["a", 0, 0, 0]), r"best.unit_stages must hold one stage"),
        (_plan_json(remat="no"), r"best.remat must be 1 true/false values"),
        (_plan_json(unit_paths=[1, 2, 3, 4]), r"unit_paths must be a list of strings"),
    ],
    ids=[
        "not-json",
        "empty",
        "list",
        "best-list",
        "str-stages",
        "float-batch",
        "int-schedule",
        "str-unit-stage",
        "str-remat",
        "int-paths",
    ],
)
def test_a_plan_file_that_is_not_a_plan_exits_2_and_writes_nothing(text, message, in_tmp, capsys):
    path = _plan_file(in_tmp, text)
    line = _train_fails([*SMALL, "--plan", path, "--run-dir", "run"], capsys)
    assert re.search(r"plan\.json.*" + message, line), line
    assert "nnx-mpmd plan --out FILE" in line
    assert sorted(p.name for p in in_tmp.iterdir()) == ["plan.json"]


def test_a_missing_plan_file_exits_2(in_tmp, capsys):
    line = _train_fails([*SMALL, "--plan", "nothing.json"], capsys)
    assert "--plan nothing.json: cannot read a plan (No such file or directory)" in line


def test_a_plan_for_another_model_family_exits_2(in_tmp, capsys):
    path = _plan_file(in_tmp, _plan_json())  # made for GPT, same layer count
    line = _train_fails([*SMALL, "--model", "llama", "--plan", path, "--run-dir", "run"], capsys)
    assert "PlanError: the plan was made for a GPT model, not for Llama" in line
    assert sorted(p.name for p in in_tmp.iterdir()) == ["plan.json"]


def test_plan_records_the_model_and_an_older_plan_is_applied_with_a_warning():
    best = Candidate("gpipe", 1, 2, (0,), (False,), 0.1, (1,))
    assert Plan.from_json(Plan(best, (), ("a",), 1, 4, model="GPT").to_json()).model == "GPT"
    older = json.loads(Plan(best, (), ("a",), 1, 4).to_json())
    del older["model"]
    with pytest.warns(UserWarning, match=r"does not say which model .* Plan again"):
        Plan.from_json(json.dumps(older)).check_model(object())
    with pytest.raises(PlanError, match=r"made for a GPT model, not for SimpleNamespace"):
        Plan(best, (), ("a",), 1, 4, model="GPT").check_model(types.SimpleNamespace())


# ------------------------------------------------------------------ checkpoint metadata


class _Manager:
    """A checkpoint manager whose latest step 3 has the given metadata."""

    def __init__(self, metadata):
        self._metadata = metadata

    def latest_step(self):
        return 3

    def metadata(self):
        return self._metadata

    def restore_newest_intact(self, tree, *, before=None, check=None):
        del tree, before
        check(3, self._metadata)


@pytest.mark.parametrize("missing", ["step", "data"])
def test_checkpoint_metadata_without_step_or_data_is_a_checkpoint_error(missing, tmp_path):
    from nnx_mpmd.apps.train_loop import Trainer

    cfg = train.config_from_args([*SMALL, "--resume", "--run-dir", str(tmp_path)])
    trainer = Trainer(cfg, tmp_path)
    saved = {"step": 3, "data": trainer.batches.state_dict(), "config": trainer.settings()}
    saved["tokenizer"] = trainer.tokenizer.to_dict()
    del saved[missing]
    with pytest.raises(
        CheckpointError, match=rf"metadata of checkpoint 3 in .* damaged: '{missing}'"
    ):
        trainer.restore_or_start(_Manager(saved))


def test_checked_metadata_names_every_problem():
    with pytest.raises(CheckpointError, match=r"'step' is -1.*; 'data' is \[\], not the data"):
        checked_metadata({"step": -1, "data": []}, pathlib.Path("ckpt"), 5)
    with pytest.raises(CheckpointError, match=r"'step' is None"):
        checked_metadata(["not", "a", "dict"], pathlib.Path("ckpt"), 5)


# ------------------------------------------------------------------ launch


def test_launch_of_a_command_that_does_not_exist_exits_2(capsys):
    status = cli.main(["launch", "-n", "2", "--", "no-such-command-h8"])
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    assert (
        "nnx-mpmd launch: error: MpmdError: cannot start process 0's command "
        "'no-such-command-h8' (No such file or directory)" in err
    )


# ------------------------------------------------------------------ memory


def test_a_run_too_big_for_the_device_exits_2_before_compiling(in_tmp, monkeypatch, capsys):
    monkeypatch.setenv("NNX_MPMD_DEVICE_MEMORY_BYTES", str(100_000))
    line = _train_fails([*SMALL, "--run-dir", "run"], capsys)
    assert re.search(
        r"PlanError: mesh 0 needs about [0-9.]+ MiB per device for the parameters, "
        r"optimizer state, gradients, batch and activations .* but a device has 0\.1 MiB\. "
        r"Use more "
        r"--meshes \(now 1\).*--skip-memory-check",
        line,
    ), line
    assert list(in_tmp.iterdir()) == []


def test_the_memory_check_is_skipped_when_asked_and_counts_the_state(tmp_path, monkeypatch):
    from nnx_mpmd.apps.memory_check import predicted_peaks
    from nnx_mpmd.apps.train_loop import Trainer

    monkeypatch.setenv("NNX_MPMD_DEVICE_MEMORY_BYTES", str(100_000))
    cfg = train.config_from_args([*SMALL, "--skip-memory-check"])
    trainer = Trainer(cfg, tmp_path)  # no PlanError
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))
    # One mesh, donated state: parameters + Adam's two moments + gradients, at least.
    assert predicted_peaks(trainer)[0] >= 4 * param_bytes


def test_the_memory_check_counts_the_activations(tmp_path, monkeypatch):
    # It used to count the state and the batch only: a long sequence with a small
    # model passed the check and then failed in XLA.
    from nnx_mpmd.apps import memory_check
    from nnx_mpmd.apps.train_loop import Trainer

    cfg = train.config_from_args([*SMALL, "--skip-memory-check"])
    trainer = Trainer(cfg, tmp_path)
    rows = cfg.batch_size // cfg.microbatches
    kept = memory_check._stage_activation_bytes(trainer, rows)
    per_block, logits = memory_check.activation_bytes_per_token(
        trainer.model.config, trainer.seq_len
    )
    assert kept == [rows * trainer.seq_len * (2 * per_block + logits)]
    with_activations = memory_check.predicted_peaks(trainer)[0]
    monkeypatch.setattr(memory_check, "_stage_activation_bytes", lambda *_: [0])
    state_only = memory_check.predicted_peaks(trainer)[0]
    assert with_activations >= state_only + kept[0]
    monkeypatch.setenv("NNX_MPMD_DEVICE_MEMORY_BYTES", str(state_only + kept[0] // 2))
    memory_check.check_memory(trainer)  # the state alone fits
    monkeypatch.undo()
    monkeypatch.setenv("NNX_MPMD_DEVICE_MEMORY_BYTES", str(state_only + kept[0] // 2))
    with pytest.raises(PlanError, match=r"mesh 0 needs about .* and activations of its stages"):
        memory_check.check_memory(trainer)
