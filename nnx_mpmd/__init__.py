"""nnx_mpmd: MPMD pipeline parallelism for Flax NNX."""

from nnx_mpmd.annotate import PipelinedModel as PipelinedModel
from nnx_mpmd.annotate import Stage as Stage
from nnx_mpmd.errors import CheckpointError as CheckpointError
from nnx_mpmd.errors import CompileError as CompileError
from nnx_mpmd.errors import DistributedError as DistributedError
from nnx_mpmd.errors import MeshError as MeshError
from nnx_mpmd.errors import MpmdError as MpmdError
from nnx_mpmd.errors import PartitionError as PartitionError
from nnx_mpmd.errors import PlacementError as PlacementError
from nnx_mpmd.errors import ScheduleError as ScheduleError

__version__ = "0.1.0"
