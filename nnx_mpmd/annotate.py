"""The stage-annotation helpers, under their public name ``nnx_mpmd.annotate``.

The implementation lives in `nnx_mpmd.frontend.annotate`; ``mp.annotate`` and
``import nnx_mpmd.annotate`` both give this module.
"""

from nnx_mpmd.frontend.annotate import *  # noqa: F403
from nnx_mpmd.frontend.annotate import __all__ as __all__
