"""What users write in model code: `Stage`, `PipelinedModel`, `assign_stages`, `ScanStack`,
and the stage markers a `Stage` call leaves in a traced program.

The bottom floor of the package above `nnx_mpmd.schedules`: placement and the compiler
read these annotations. ``mp.annotate`` and ``import nnx_mpmd.annotate`` give this
package; its names are those of `nnx_mpmd.annotate.annotate`.
"""

from nnx_mpmd.annotate.annotate import *  # noqa: F403
from nnx_mpmd.annotate.annotate import __all__ as __all__
