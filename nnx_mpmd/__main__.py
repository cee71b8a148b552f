"""``python -m nnx_mpmd``: the same command line as ``nnx-mpmd``."""

from nnx_mpmd.apps.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
