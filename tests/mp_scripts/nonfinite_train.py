"""``nnx-mpmd train`` with one inf in the token embedding (stage 0), for --check-finite.

Usage (under ``nnx-mpmd launch``): ``python nonfinite_train.py TRAIN_ARGS...``. The
first step makes a non-finite stage output on the process that holds stage 0;
with ``--check-finite`` every process must name it (stage 0, task F0.0).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("NNX_MPMD_DUMP_AFTER_S"):  # print every stack if the script hangs
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["NNX_MPMD_DUMP_AFTER_S"]), exit=True)

import numpy as np

from nnx_mpmd.apps import train, train_loop

_build_model = train_loop.build_model


def _poisoned(*args, **kwargs):
    model = _build_model(*args, **kwargs)
    table = model.embed.module.token.table
    table.set_value(table.get_value().at[:, 0].set(np.inf))
    return model


train_loop.build_model = _poisoned

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
