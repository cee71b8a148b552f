"""nnx_mpmd: MPMD pipeline parallelism for Flax NNX.

Wrap layers of an NNX model in `Stage`, compile an ordinary NNX train step with
`jit`, pick a schedule, and each stage runs on its own submesh.
"""

from importlib import metadata as _metadata

from nnx_mpmd import annotate as annotate
from nnx_mpmd import checkpoint as checkpoint
from nnx_mpmd import distributed as distributed
from nnx_mpmd import errors as errors
from nnx_mpmd import planner as planner
from nnx_mpmd import schedules as schedules
from nnx_mpmd.annotate.annotate import PipelinedModel as PipelinedModel
from nnx_mpmd.annotate.annotate import ScanStack as ScanStack
from nnx_mpmd.annotate.annotate import Stage as Stage
from nnx_mpmd.annotate.annotate import assign_stages as assign_stages
from nnx_mpmd.annotate.annotate import auto_stage as auto_stage
from nnx_mpmd.aot.compile_cache import enable_compile_cache as enable_compile_cache
from nnx_mpmd.compiler.outer.mesh_inference import MpmdTransferWarning as MpmdTransferWarning
from nnx_mpmd.compiler.trace.trace_step import ReplicatedBatchWarning as ReplicatedBatchWarning
from nnx_mpmd.distributed import gather as gather
from nnx_mpmd.errors import CheckpointDamagedError as CheckpointDamagedError
from nnx_mpmd.errors import CheckpointError as CheckpointError
from nnx_mpmd.errors import CompileError as CompileError
from nnx_mpmd.errors import DistributedError as DistributedError
from nnx_mpmd.errors import MeshError as MeshError
from nnx_mpmd.errors import MpmdError as MpmdError
from nnx_mpmd.errors import NonFiniteError as NonFiniteError
from nnx_mpmd.errors import PartitionError as PartitionError
from nnx_mpmd.errors import PlacementError as PlacementError
from nnx_mpmd.errors import PlanError as PlanError
from nnx_mpmd.errors import ScheduleError as ScheduleError
from nnx_mpmd.jit.functional_cache import FunctionalKVCache as FunctionalKVCache
from nnx_mpmd.jit.generate import Generator as Generator
from nnx_mpmd.jit.jit import Lowered as Lowered
from nnx_mpmd.jit.jit import PipelinedFunction as PipelinedFunction
from nnx_mpmd.jit.jit import jit as jit
from nnx_mpmd.jit.losses import value_and_grad as value_and_grad
from nnx_mpmd.jit.precision import Precision as Precision
from nnx_mpmd.jit.stages import Compiled as Compiled
from nnx_mpmd.jit.stages import Traced as Traced
from nnx_mpmd.placement.mesh import MpmdMesh as MpmdMesh
from nnx_mpmd.placement.mpmd_array import MpmdArray as MpmdArray
from nnx_mpmd.placement.place import place as place
from nnx_mpmd.planner import Plan as Plan
from nnx_mpmd.planner import plan as plan
from nnx_mpmd.schedules import Custom as Custom
from nnx_mpmd.schedules import DualPipeV as DualPipeV
from nnx_mpmd.schedules import Eager1F1B as Eager1F1B
from nnx_mpmd.schedules import GPipe as GPipe
from nnx_mpmd.schedules import Interleaved1F1B as Interleaved1F1B
from nnx_mpmd.schedules import LoopedBFS as LoopedBFS
from nnx_mpmd.schedules import OneFOneB as OneFOneB
from nnx_mpmd.schedules import Task as Task
from nnx_mpmd.schedules import ZeroBubbleH1 as ZeroBubbleH1
from nnx_mpmd.schedules import ZeroBubbleH2 as ZeroBubbleH2
from nnx_mpmd.schedules import ZeroBubbleV as ZeroBubbleV

try:  # the installed distribution's version, so it cannot drift from pyproject.toml
    __version__ = _metadata.version("nnx-mpmd")
except _metadata.PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.28.0"

__all__ = [
    "CheckpointDamagedError",
    "CheckpointError",
    "CompileError",
    "Compiled",
    "Custom",
    "DistributedError",
    "DualPipeV",
    "Eager1F1B",
    "FunctionalKVCache",
    "GPipe",
    "Generator",
    "Interleaved1F1B",
    "LoopedBFS",
    "Lowered",
    "MeshError",
    "MpmdArray",
    "MpmdError",
    "MpmdMesh",
    "MpmdTransferWarning",
    "NonFiniteError",
    "OneFOneB",
    "PartitionError",
    "PipelinedFunction",
    "PipelinedModel",
    "PlacementError",
    "Plan",
    "PlanError",
    "Precision",
    "ReplicatedBatchWarning",
    "ScanStack",
    "ScheduleError",
    "Stage",
    "Task",
    "Traced",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "ZeroBubbleV",
    "annotate",
    "assign_stages",
    "auto_stage",
    "checkpoint",
    "distributed",
    "enable_compile_cache",
    "errors",
    "gather",
    "jit",
    "place",
    "plan",
    "schedules",
    "value_and_grad",
]
