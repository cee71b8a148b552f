"""The ``nnx-mpmd`` command line: ``train``, ``generate``, ``convert``, ``schedule``, ``bench``,
``launch``, ``plan``.

Each subcommand lives in its own module and is imported only when used, so
``nnx-mpmd schedule`` starts without importing JAX.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

__all__ = ["main", "report_unexpected", "version"]

#: Set to 1 to print the traceback of an unexpected error (one line otherwise).
ENV_TRACEBACK = "NNX_MPMD_TRACEBACK"

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("nnx_mpmd.apps.train", "train a model-zoo language model with a pipeline schedule"),
    "generate": ("nnx_mpmd.apps.generate_cli", "continue a prompt with a trained run's model"),
    "schedule": ("nnx_mpmd.apps.schedule_cli", "print, simulate and draw a pipeline schedule"),
    "bench": ("nnx_mpmd.apps.bench", "benchmark pipelined steps against SPMD baselines"),
    "launch": ("nnx_mpmd.apps.launch", "start N local processes under jax.distributed"),
    "plan": ("nnx_mpmd.apps.plan", "choose split, schedule, microbatches and remat by measuring"),
    "convert": ("nnx_mpmd.apps.convert", "Hugging Face model dir <-> run directory checkpoint"),
}


def version() -> str:
    """The installed version of nnx-mpmd (package metadata; ``nnx_mpmd.__version__`` if absent).

    Example:
      >>> import nnx_mpmd
      >>> version() == nnx_mpmd.__version__
      True
    """
    from importlib import metadata

    try:
        return metadata.version("nnx-mpmd")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        import nnx_mpmd

        return nnx_mpmd.__version__


def report_unexpected(program: str, error: BaseException) -> int:
    """Prints one line for an error that is not an `MpmdError` and returns exit status 1.

    The traceback only with ``NNX_MPMD_TRACEBACK=1``: a CLI user sees what failed, not frames.

    Example:
      >>> report_unexpected("nnx-mpmd train", RuntimeError("boom"))  # doctest: +SKIP
      1
    """
    if os.environ.get(ENV_TRACEBACK) == "1":
        traceback.print_exception(error, file=sys.stderr)
        hint = "the traceback is above"
    else:
        hint = f"rerun with {ENV_TRACEBACK}=1 for the traceback"
    text = " ".join(str(error).split())[:500]
    print(
        f"{program}: unexpected error: {type(error).__name__}: {text} ({hint}; if it is not "
        "caused by your files or system, please report it)",
        file=sys.stderr,
    )
    return 1


def _usage() -> str:
    lines = [
        "usage: nnx-mpmd [--version] {" + ",".join(SUBCOMMANDS) + "} [options]",
        "",
        "subcommands:",
    ]
    lines += [f"  {name:<9} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Run 'nnx-mpmd SUBCOMMAND --help' for the options of one subcommand."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nnx-mpmd``; returns the exit status.

    Example:
      >>> main(["--help"])  # doctest: +ELLIPSIS
      usage: nnx-mpmd ...
      0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(f"{_usage()}\n\nnnx-mpmd: error: name a subcommand", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"nnx-mpmd {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"nnx-mpmd: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    from nnx_mpmd.errors import MpmdError

    try:
        return int(module.main(rest) or 0)
    except MpmdError as e:  # a subcommand that let one through: still one line, status 2
        print(f"nnx-mpmd {name}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # not ours: one line, the traceback on request
        return report_unexpected(f"nnx-mpmd {name}", e)
