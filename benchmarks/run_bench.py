"""Runs ``nnx-mpmd bench`` from a checkout: ``python benchmarks/run_bench.py [options]``.

Results go to ``benchmarks/results/<date>-<machine>.json``; see ``BENCHMARKS.md``
for what each column means. ``make bench BENCH_ARGS="--presets tiny"`` does the
same through the package's command line.

Example:
    >>> import subprocess, sys
    >>> out = subprocess.run([sys.executable, __file__, "--help"], capture_output=True, text=True)
    >>> "nnx-mpmd bench" in out.stdout
    True
"""

from __future__ import annotations

import sys

from nnx_mpmd.apps.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
