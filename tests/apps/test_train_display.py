"""What ``nnx-mpmd train`` shows: the header's schedule name and layer count, the
progress bar while the first step compiles, the loss from step 1, and the hint
to use ``.venv`` after ``make demo``. The pieces are tested directly (a CLI run
takes 30-60 s; tests/apps/test_cli.py runs the command itself)."""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from nnx_mpmd.apps import train_display
from nnx_mpmd.apps.train import config_from_args
from nnx_mpmd.apps.train_display import (
    CompileCounter,
    first_step_status,
    progress_bar,
    schedule_label,
    step_status,
    venv_hint,
)
from nnx_mpmd.apps.train_loop import Trainer
from nnx_mpmd.schedules import SCHEDULES, get_schedule


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_label_is_the_command_line_name(name):
    assert schedule_label(get_schedule(name)) == name


def test_schedule_label_shows_parameters_that_differ_from_the_default():
    label = schedule_label(get_schedule("interleaved", virtual_stages=3))
    assert label == "interleaved (virtual_stages=3)"


def _trainer(tmp_path, *argv):
    small = ["--data", "1", "--steps", "1", "--batch-size", "4", "--microbatches", "4"]
    cfg = config_from_args([*argv, *small, "--corpus-bytes", "20000", "--run-dir", str(tmp_path)])
    return Trainer(cfg, tmp_path)


def test_header_names_the_schedule_and_the_layers_it_added(tmp_path):
    header = _trainer(tmp_path, "--schedule", "interleaved", "--meshes", "4")._header()
    assert "schedule interleaved," in header, header
    assert "Interleaved1F1B(" not in header
    # 8 stages on 4 meshes: the tiny preset's 4 layers become 8, said up front.
    assert "gpt tiny: 8 layers (the preset has 4)," in header
    assert "8 stages on 4 meshes" in header


def test_header_of_a_preset_that_fits_states_its_layers_only(tmp_path):
    header = _trainer(tmp_path, "--schedule", "1f1b", "--meshes", "2")._header()
    assert "gpt tiny: 4 layers," in header and "preset has" not in header
    assert "schedule 1f1b," in header and "OneFOneB" not in header


def test_progress_bar_says_the_first_step_compiles():
    progress, task = progress_bar(300, 0, shown=False)
    status = progress.tasks[0].fields["status"]
    assert status == "step 1: tracing and compiling the stage programs..."
    resumed, _ = progress_bar(300, 50, shown=False)
    assert resumed.tasks[0].fields["status"].startswith("step 51: ")
    progress.update(task, completed=1, status=step_status(4.3812, 1234.5))
    assert progress.tasks[0].fields["status"] == "loss 4.381  1,234 tok/s"


def test_compile_counter_counts_compilations_and_cache_hits_while_entered():
    seen = []
    with CompileCounter(lambda c: seen.append(c.programs)) as counter:
        jax.jit(lambda x: jnp.sin(x) * 41.5 - 3)(jnp.arange(7.0)).block_until_ready()
        jax.monitoring.record_event(train_display._CACHE_HIT_EVENT)
    assert counter.programs >= 1 and seen == list(range(1, counter.programs + 1))
    assert counter.cache_hits == 1
    programs = counter.programs
    jax.jit(lambda x: jnp.cos(x) * 40.5 - 3)(jnp.arange(7.0)).block_until_ready()
    assert counter.programs == programs  # not counting after exit
    assert (
        counter.text(cache_on=True)
        == f"compiled {programs} program" + ("s" * (programs != 1)) + ", 1 from the compile cache"
    )
    assert counter.text(cache_on=False).endswith(", compile cache off")


def test_first_step_status_counts_programs_as_they_finish():
    counter = CompileCounter()
    assert first_step_status(1, counter, cache_on=False).startswith("step 1: tracing")
    counter.programs, counter.cache_hits = 5, 2
    assert first_step_status(1, counter, cache_on=True) == (
        "step 1: tracing and compiling the stage programs... compiled 5 programs, "
        "2 from the compile cache"
    )


def test_venv_hint_after_make_demo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    venv = tmp_path / ".venv"
    hint = venv_hint(str(venv), "/usr", "/usr/bin:/bin")
    assert hint is not None
    assert "source .venv/bin/activate" in hint
    assert ".venv/bin/python examples/01_quickstart.py" in hint
    assert ".venv/bin/nnx-mpmd --help" in hint


@pytest.mark.parametrize(
    "prefix, base, path",
    [
        ("/usr", "/usr", "/usr/bin"),  # not in a virtual environment
        ("/x/.venv", "/usr", os.pathsep.join(["/x/.venv/bin", "/usr/bin"])),  # activated
    ],
)
def test_no_venv_hint_where_python_and_nnx_mpmd_already_work(prefix, base, path):
    assert venv_hint(prefix, base, path) is None


def test_venv_hint_outside_the_current_directory_gives_the_full_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hint = venv_hint("/opt/envs/mp", "/usr", "/usr/bin")
    assert hint is not None and f"source {pathlib.Path('/opt/envs/mp')}/bin/activate" in hint
