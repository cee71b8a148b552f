"""The ``nnx-mpmd`` command line as a newcomer meets it: a plain install, --version,
every schedule with the defaults, --help of every subcommand, and clear errors.

The tests that need a fresh process (a plain install, the installed script,
``train --help`` through the real entry point) run the real command in a subprocess
(``python -m nnx_mpmd``), with 8 simulated CPU devices as tests/apps/test_train.py
does; the others, every schedule's first step included, call `cli.main` in this
process, which reads the same argv and reports errors the same way, without a
Python and JAX start of their own (about 3 CPU seconds each).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from importlib import metadata

import jax
import pytest

import nnx_mpmd
from nnx_mpmd.apps import cli, schedule_cli
from nnx_mpmd.schedules.draw import PLOTS_INSTALL, time_axis_label
from nnx_mpmd.schedules.registry import SCHEDULES
from nnx_mpmd.schedules.simulate import Costs

REPO = pathlib.Path(__file__).resolve().parents[2]

# A train run small enough to finish in seconds: 2 stages on 2 meshes.
TINY = [
    "--meshes", "2", "--data", "1", "--layers", "2", "--batch-size", "8",
    "--microbatches", "2", "--seq-len", "32", "--corpus-bytes", "100000",
    "--log-every", "1", "--ckpt-every", "0", "--warmup", "1",
    "--val-batches", "0", "--sample-tokens", "0",
]  # fmt: skip

# Runs nnx_mpmd's command line in a Python where `import matplotlib` fails, as in a
# plain `pip install nnx-mpmd` without the plots extra.
WITHOUT_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "
    "from nnx_mpmd.apps.cli import main; raise SystemExit(main(sys.argv[1:]))"
)


def _env() -> dict[str, str]:
    # This test run's compilation cache (tests/conftest.py), never the user's home
    # (tests/apps/test_train.py checks the default): runs of the same tiny model load
    # the programs an earlier run (or test worker) compiled.
    cache = jax.config.jax_compilation_cache_dir or "off"
    env = dict(os.environ, JAX_PLATFORMS="cpu", NNX_MPMD_COMPILE_CACHE=cache)
    flag = "--xla_force_host_platform_device_count=8"
    if flag not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    return env


def _run(
    args: list[str],
    cwd: pathlib.Path | None = None,
    timeout: int = 300,
    env: dict[str, str] | None = None,
):
    return subprocess.run(
        args, capture_output=True, text=True, env={**_env(), **(env or {})}, cwd=cwd,
        timeout=timeout,
    )  # fmt: skip


def _nnx_mpmd(
    *args: str,
    cwd: pathlib.Path | None = None,
    timeout: int = 300,
    env: dict[str, str] | None = None,
):
    return _run([sys.executable, "-m", "nnx_mpmd", *args], cwd=cwd, timeout=timeout, env=env)


def _in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``nnx-mpmd ARGS`` through `cli.main` in this process, as a finished subprocess reads."""
    capsys.readouterr()
    try:
        status = cli.main(list(args))
    except SystemExit as e:  # argparse's --help and usage errors
        status = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["nnx-mpmd", *args], status, out, err)


def _one_line_error(proc: subprocess.CompletedProcess, prefix: str) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(errors) == 1, proc.stderr
    return errors[0]


# -- 1. a plain install: no matplotlib ---------------------------------------------------


def test_train_without_matplotlib_skips_each_picture_with_the_install_hint(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["train", *TINY, "--steps", "2", "--profile", "--run-dir", str(run_dir)]
    proc = _run([sys.executable, "-c", WITHOUT_MATPLOTLIB, *argv])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for name in ("schedule_measured.png", "schedule.png", "loss.png"):
        hint = f"skipped {name}: matplotlib is not installed; {PLOTS_INSTALL} to draw it"
        assert proc.stdout.count(hint) == 1, proc.stdout
        assert not (run_dir / name).exists()
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 2


def test_schedule_picture_without_matplotlib_is_one_clear_error(tmp_path):
    png = tmp_path / "s.png"
    args = ["schedule", "--png", str(png)]
    proc = _run([sys.executable, "-c", WITHOUT_MATPLOTLIB, *args])
    line = _one_line_error(proc, "nnx-mpmd schedule: error:")
    assert "matplotlib is not installed" in line and PLOTS_INSTALL in line
    assert not png.exists()


def test_pyproject_has_a_plots_extra_that_dev_and_docs_include():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["plots"] == ["matplotlib>=3.8"]
    assert "matplotlib" not in " ".join(
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    )
    for extra in ("dev", "docs"):
        assert any(req.startswith(("matplotlib", "nnx-mpmd[plots]")) for req in extras[extra])


def test_ci_runs_the_suite_with_lint_and_a_plain_install_that_trains_beside_it():
    script = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test$", script, re.MULTILINE), script
    # Lint and the plain install run in the background; the run waits for each and
    # fails with it.
    assert re.search(r"^lint\(\) \{\n  make lint\n", script, re.MULTILINE), script
    for job, what in (("lint", "lint"), ("plain", "plain_install_and_train")):
        assert re.search(rf"{what}\) >\S+ 2>&1 &\n{job}_pid=\$!", script), job
        assert f'finish "${job}_pid"' in script, job
    assert script.index("make test") < script.index('finish "$lint_pid"')
    assert re.search(r"timeout -k 5 600 \S*nnx-mpmd\"? train --steps 2", script), script
    assert "--xla_force_host_platform_device_count=8" in script
    assert "[dev]" not in script and "[plots]" not in script


# -- 2. --version -------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        [str(pathlib.Path(sys.executable).parent / "nnx-mpmd")],
        [sys.executable, "-m", "nnx_mpmd"],
    ],
    ids=["script", "python-m"],
)
def test_version_is_the_package_version(command):
    if not pathlib.Path(command[0]).exists():
        pytest.skip(f"{command[0]} is not installed next to this Python")
    proc = _run([*command, "--version"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"nnx-mpmd {nnx_mpmd.__version__}\n"
    assert metadata.version("nnx-mpmd") == nnx_mpmd.__version__ == cli.version()


# The launcher parent only starts processes: JAX and the rest load in its children.
LAUNCHER_IMPORTS = """
import sys
from nnx_mpmd.apps.cli import main
main(["--version"])
main(["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2"])
status = main(["launch", "-n", "2", "--", sys.executable, "-c", "print('child')"])
heavy = {name.split(".")[0] for name in sys.modules} & {"jax", "flax", "optax", "orbax", "numpy"}
print("status", status, "heavy", sorted(heavy))
"""


def test_launcher_version_and_schedule_do_not_import_jax():
    proc = _run([sys.executable, "-c", LAUNCHER_IMPORTS], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("child") == 2, proc.stdout
    assert proc.stdout.rstrip().endswith("status 0 heavy []"), proc.stdout


def test_no_subcommand_and_unknown_subcommand_exit_2(capsys):
    assert cli.main([]) == 2
    assert capsys.readouterr().err.rstrip().endswith("nnx-mpmd: error: name a subcommand")
    assert cli.main(["trian"]) == 2
    assert "unknown subcommand 'trian'" in capsys.readouterr().err


# -- 3. every registered schedule with the default preset ------------------------------


@pytest.fixture
def stores_as_the_command_does(monkeypatch):
    """`nnx_mpmd.aot`'s stores as in a process of ``nnx-mpmd train``, not as tests/conftest.py
    sets them for tests that count compilations: whole steps are stored, and the programs
    of every test that uses this share one folder (GPipe's stage programs are 1F1B's, say)."""
    from nnx_mpmd.aot import program_sharing, step_store

    monkeypatch.setattr(step_store, "ENABLED", True)
    monkeypatch.setattr(program_sharing, "_STORE_FOLDER", "nnx_mpmd_shared-cli-schedules")


@pytest.mark.slow  # compiles 4-8 stage programs on 4 meshes: 10-20 s each on 2 cores
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_train_runs_every_schedule_with_the_default_preset(
    name, tmp_path, capsys, stores_as_the_command_does
):
    argv = ["train", "--schedule", name, "--steps", "1", "--batch-size", "16"]
    argv += ["--seq-len", "16", "--corpus-bytes", "50000", "--val-batches", "0"]
    argv += ["--sample-tokens", "0", "--ckpt-every", "0", "--run-dir", str(tmp_path)]
    # In this process, without a Python and JAX start per schedule (the real entry point
    # runs in test_help_has_no_markup_and_says_each_default_once and the plain-install
    # test). The schedules share most stage programs: this test run's compilation cache
    # (tests/conftest.py), which every test worker shares, compiles each once.
    proc = _in_process(capsys, *argv)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step 1/1  loss" in proc.stdout
    if SCHEDULES[name]().default_num_stages(4) > 4:  # the tiny preset has 4 layers
        assert "using 8 layers (one per stage)" in proc.stdout


def test_too_few_explicit_layers_name_the_flag_to_add(tmp_path, capsys):
    argv = ["train", "--schedule", "zb-v", "--layers", "4", "--run-dir", str(tmp_path)]
    proc = _in_process(capsys, *argv)
    line = _one_line_error(proc, "nnx-mpmd train: error:")
    assert "--layers 4 is too few: --schedule zb-v runs 8 stages on 4 meshes" in line
    assert "add --layers 8" in line


# -- 4. --resume without an earlier run ------------------------------------------------


def test_resume_without_any_run_is_an_error_and_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    proc = _in_process(capsys, "train", "--resume", "--steps", "2")
    line = _one_line_error(proc, "nnx-mpmd train: error:")
    assert "--resume: no earlier run with checkpoints under" in line
    assert list(tmp_path.iterdir()) == []


def test_resume_into_a_missing_run_dir_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    proc = _in_process(capsys, "train", "--resume", "--run-dir", str(missing))
    line = _one_line_error(proc, "nnx-mpmd train: error:")
    assert f"--resume: {missing} holds no checkpoints/ directory" in line
    assert not missing.exists()


# -- 5. schedule pictures, bad ints, --help ---------------------------------------------


def test_schedule_png_in_a_missing_directory_creates_it(tmp_path, capsys):
    png = tmp_path / "some" / "missing" / "dir" / "x.png"
    assert schedule_cli.main(["--schedule", "gpipe", "--meshes", "2", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"created directory {png.parent}" in out and f"wrote {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_schedule_png_where_no_directory_can_be_made_is_one_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert schedule_cli.main(["--png", str(blocker / "x.png")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"cannot create the directory .*file.* for .*x\.png", err), err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--meshes", "0", "must be an int >= 1, got 0"),
        ("--meshes", "-3", "must be an int >= 1, got -3"),
        ("--stages", "0", "must be an int >= 1, got 0"),
        ("--virtual", "0", "must be an int >= 1, got 0"),
        ("--microbatches", "0", "must be an int >= 1, got 0"),
        ("--microbatches", "2.5", "invalid int value: '2.5'"),
        ("--slot", "0", "must be a number > 0, got 0"),
        ("--slot", "nan", "must be a number > 0, got nan"),
    ],
)
def test_schedule_bad_numbers_name_the_flag_typed(flag, value, message, capsys):
    assert schedule_cli.main([flag, value]) == 2
    err = capsys.readouterr().err
    assert f"nnx-mpmd schedule: error: argument {flag}: {message}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--meshes", "0"), ("--layers", "0"), ("--seq-len", "0"), ("--stages", "0")],
)
def test_train_bad_numbers_name_the_flag_typed(flag, value, tmp_path, capsys):
    from nnx_mpmd.apps import train

    assert train.main([flag, value, "--run-dir", str(tmp_path)]) == 2
    assert f"{flag}={value} must be >= 1" in capsys.readouterr().err


def test_schedule_pictures_state_their_time_unit(tmp_path, monkeypatch):
    figures = []
    draw = schedule_cli.plot_gantt

    def recording_plot_gantt(*args, **kwargs):
        figures.append(draw(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(schedule_cli, "plot_gantt", recording_plot_gantt)
    for argv in (["--schedule", "1f1b"], ["--schedule", "zb-h1", "--costs", "F=2,B=4"]):
        assert schedule_cli.main([*argv, "--png", str(tmp_path / "x.png")]) == 0
    default, doubled = (fig.axes[0] for fig in figures)
    assert default.get_xlabel() == "time (units of one forward, F=1)"
    assert "makespan 33" in default.get_title()
    assert doubled.get_xlabel() == "time (cost units: F=2, B=4, BI=1, BW=1, transfer=0)"
    assert time_axis_label(Costs(B=3.0)).startswith("time (units of one forward; costs F=1, B=3")


SUBCOMMAND_HELP = [[name, "--help"] for name in cli.SUBCOMMANDS] + [["--help"]]


@pytest.mark.parametrize("argv", SUBCOMMAND_HELP, ids=lambda argv: argv[0])
def test_help_has_no_markup_and_says_each_default_once(argv, monkeypatch, capsys):
    if argv == ["train", "--help"]:  # once through the real command line
        proc = _nnx_mpmd(*argv, timeout=120)
    else:
        monkeypatch.setenv("COLUMNS", "80")  # argparse wraps as for a subprocess's pipe
        proc = _in_process(capsys, *argv)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "usage:" in text
    # One entry per option: a line that starts with "  -" and its continuation lines.
    entries = re.split(r"\n(?=  -)", text)
    for entry in entries:
        assert len(re.findall(r"\(default", entry)) <= 1, entry
        assert "(default: None)" not in entry and "(default: False)" not in entry, entry
    assert "`" not in text, text


# -- 6. schedule makespans in the docs' units --------------------------------------------


# docs/concepts.md's table: 4 meshes, 8 microbatches, 8-stage tasks cost half.
DOCS_MAKESPANS = {"1f1b": "33", "gpipe": "33", "interleaved": "28.5", "looped-bfs": "28.5"}
DOCS_MAKESPANS |= {"zb-h1": "27", "zb-v": "25.5", "dualpipev": "25.5"}


@pytest.mark.parametrize(("name", "makespan"), DOCS_MAKESPANS.items())
def test_schedule_makespans_compare_across_stage_counts_as_in_the_docs(name, makespan, capsys):
    assert schedule_cli.main(["--schedule", name, "--meshes", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert f"makespan {makespan}," in out, out
    assert "time unit: one forward through one mesh's layers (F=1, B=2)" in out
    if SCHEDULES[name]().default_num_stages(4) == 8:
        assert "costs F=0.5 B=1 BI=0.5 BW=0.5 transfer=0" in out
        assert "each of the 8 stages holds 1/2 of them" in out


def test_schedule_costs_given_per_task_are_not_scaled_and_say_so(capsys):
    argv = ["--schedule", "zb-v", "--meshes", "4", "--microbatches", "8"]
    assert schedule_cli.main([*argv, "--costs", "F=1,B=2,BI=1,BW=1"]) == 0
    out = capsys.readouterr().out
    assert "makespan 51," in out
    assert "time unit: the task costs given by --costs (per task, not scaled" in out
    # A transfer delay alone keeps the scaled task costs.
    assert schedule_cli.main([*argv, "--costs", "transfer=0.5"]) == 0
    out = capsys.readouterr().out
    assert "costs F=0.5 B=1 BI=0.5 BW=0.5 transfer=0.5" in out


# -- 7. nnx-mpmd plan: what applies, progress, where it writes ---------------------------


def test_plan_help_lists_only_the_options_that_change_a_plan():
    from nnx_mpmd.apps import plan as plan_app

    text = plan_app.build_parser().format_help()
    listed = set(re.findall(r"^  (--[\w-]+)", text, re.MULTILINE))
    assert not listed & {"--resume", "--sample-tokens", "--ckpt-every", "--run-dir", "--plan"}
    assert {"--meshes", "--batch-size", "--layers", "--out", "--verify"} <= listed
    assert "plan.json in the current directory" in text


def test_plan_refuses_train_only_options(capsys):
    from nnx_mpmd.apps import plan as plan_app

    assert plan_app.main(["--resume", "--sample-tokens=0"]) == 2
    err = capsys.readouterr().err
    assert "nnx-mpmd plan: error: --resume, --sample-tokens belong(s) to nnx-mpmd train only" in err


def test_plan_says_what_it_does_before_it_profiles_and_where_it_writes(
    tmp_path, monkeypatch, capsys
):
    from types import SimpleNamespace

    import nnx_mpmd.planner
    from nnx_mpmd.apps import plan as plan_app

    said_before = []

    class FakePlan:
        best = SimpleNamespace(schedule="1f1b", num_stages=2, num_microbatches=4)

        def summary(self):
            return "| summary |"

        def verdict(self):
            return "do not pipeline: the verdict line"

        def save(self, path):
            pathlib.Path(path).write_text("{}")

    def fake_plan(*args, **kwargs):
        said_before.append(capsys.readouterr().out)
        return FakePlan()

    monkeypatch.setattr(nnx_mpmd.planner, "plan", fake_plan)
    monkeypatch.chdir(tmp_path)
    cfg = plan_app.build_parser().parse_args(["--meshes", "2", "--data", "1"])
    trainer = SimpleNamespace(
        batches=iter([{}]), optimizer=SimpleNamespace(tx=None), model=None, mesh=None,
        num_layers=4,
    )  # fmt: skip
    plan_app._plan_and_save(cfg, trainer)
    out = capsys.readouterr().out
    where = tmp_path.resolve() / "plan.json"
    assert f"the plan goes to {where}" in said_before[0]
    assert "profiling every layer on one submesh" in said_before[0]
    assert "profiled and searched in" in out and f"wrote {where}: 1f1b" in out
    assert "do not pipeline: the verdict line\n" in out
    assert where.exists()


def test_an_unexpected_train_error_is_one_line_and_status_1(tmp_path, monkeypatch, capsys):
    from nnx_mpmd.apps import train

    def broken_run(cfg, stop=None):
        raise RuntimeError("the disk controller\nexploded")

    monkeypatch.setattr(train, "run", broken_run)
    monkeypatch.delenv("NNX_MPMD_TRACEBACK", raising=False)
    assert train.main(["--run-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert re.match(
        r"nnx-mpmd train: unexpected error: RuntimeError: the disk controller exploded "
        r"\(rerun with NNX_MPMD_TRACEBACK=1 for the traceback",
        lines[0],
    ), lines
    monkeypatch.setenv("NNX_MPMD_TRACEBACK", "1")
    assert train.main(["--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken_run" in err, err
    assert err.strip().splitlines()[-1].startswith("nnx-mpmd train: unexpected error:")


def test_an_unexpected_subcommand_error_is_one_line(monkeypatch, capsys):
    def broken_main(argv):
        raise KeyError("stage")

    monkeypatch.setattr(schedule_cli, "main", broken_main)
    monkeypatch.delenv("NNX_MPMD_TRACEBACK", raising=False)
    assert cli.main(["schedule"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nnx-mpmd schedule: unexpected error: KeyError: 'stage' (rerun"), err
    assert "Traceback" not in err
