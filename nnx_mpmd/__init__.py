"""nnx_mpmd: MPMD pipeline parallelism for Flax NNX.

Wrap layers of an NNX model in `Stage`, compile an ordinary NNX train step with
`jit`, pick a schedule, and each stage runs on its own submesh.
"""

from __future__ import annotations

import importlib
import sys
import types
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what each public name is, for type checkers and readers; loaded on first use
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

# public name -> (module, attribute; None when the name is the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "annotate": ("nnx_mpmd.annotate", None),
    "checkpoint": ("nnx_mpmd.checkpoint", None),
    "distributed": ("nnx_mpmd.distributed", None),
    "errors": ("nnx_mpmd.errors", None),
    "planner": ("nnx_mpmd.planner", None),
    "schedules": ("nnx_mpmd.schedules", None),
    "PipelinedModel": ("nnx_mpmd.annotate.annotate", "PipelinedModel"),
    "ScanStack": ("nnx_mpmd.annotate.annotate", "ScanStack"),
    "Stage": ("nnx_mpmd.annotate.annotate", "Stage"),
    "assign_stages": ("nnx_mpmd.annotate.annotate", "assign_stages"),
    "auto_stage": ("nnx_mpmd.annotate.annotate", "auto_stage"),
    "enable_compile_cache": ("nnx_mpmd.aot.compile_cache", "enable_compile_cache"),
    "MpmdTransferWarning": ("nnx_mpmd.compiler.outer.mesh_inference", "MpmdTransferWarning"),
    "ReplicatedBatchWarning": ("nnx_mpmd.compiler.trace.trace_step", "ReplicatedBatchWarning"),
    "gather": ("nnx_mpmd.distributed", "gather"),
    "CheckpointDamagedError": ("nnx_mpmd.errors", "CheckpointDamagedError"),
    "CheckpointError": ("nnx_mpmd.errors", "CheckpointError"),
    "CompileError": ("nnx_mpmd.errors", "CompileError"),
    "DistributedError": ("nnx_mpmd.errors", "DistributedError"),
    "MeshError": ("nnx_mpmd.errors", "MeshError"),
    "MpmdError": ("nnx_mpmd.errors", "MpmdError"),
    "NonFiniteError": ("nnx_mpmd.errors", "NonFiniteError"),
    "PartitionError": ("nnx_mpmd.errors", "PartitionError"),
    "PlacementError": ("nnx_mpmd.errors", "PlacementError"),
    "PlanError": ("nnx_mpmd.errors", "PlanError"),
    "ScheduleError": ("nnx_mpmd.errors", "ScheduleError"),
    "FunctionalKVCache": ("nnx_mpmd.jit.functional_cache", "FunctionalKVCache"),
    "Generator": ("nnx_mpmd.jit.generate", "Generator"),
    "Lowered": ("nnx_mpmd.jit.jit", "Lowered"),
    "PipelinedFunction": ("nnx_mpmd.jit.jit", "PipelinedFunction"),
    "jit": ("nnx_mpmd.jit.jit", "jit"),
    "value_and_grad": ("nnx_mpmd.jit.losses", "value_and_grad"),
    "Precision": ("nnx_mpmd.jit.precision", "Precision"),
    "Compiled": ("nnx_mpmd.jit.stages", "Compiled"),
    "Traced": ("nnx_mpmd.jit.stages", "Traced"),
    "MpmdMesh": ("nnx_mpmd.placement.mesh", "MpmdMesh"),
    "MpmdArray": ("nnx_mpmd.placement.mpmd_array", "MpmdArray"),
    "place": ("nnx_mpmd.placement.place", "place"),
    "Plan": ("nnx_mpmd.planner", "Plan"),
    "plan": ("nnx_mpmd.planner", "plan"),
    "Custom": ("nnx_mpmd.schedules", "Custom"),
    "DualPipeV": ("nnx_mpmd.schedules", "DualPipeV"),
    "Eager1F1B": ("nnx_mpmd.schedules", "Eager1F1B"),
    "GPipe": ("nnx_mpmd.schedules", "GPipe"),
    "Interleaved1F1B": ("nnx_mpmd.schedules", "Interleaved1F1B"),
    "LoopedBFS": ("nnx_mpmd.schedules", "LoopedBFS"),
    "OneFOneB": ("nnx_mpmd.schedules", "OneFOneB"),
    "Task": ("nnx_mpmd.schedules", "Task"),
    "ZeroBubbleH1": ("nnx_mpmd.schedules", "ZeroBubbleH1"),
    "ZeroBubbleH2": ("nnx_mpmd.schedules", "ZeroBubbleH2"),
    "ZeroBubbleV": ("nnx_mpmd.schedules", "ZeroBubbleV"),
}

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


if not TYPE_CHECKING:  # hidden from type checkers, which then still flag a misspelt name

    def __getattr__(name: str) -> Any:
        """Imports a public name on its first use (PEP 562), so that ``import nnx_mpmd``
        and the command line's launcher do not pay for JAX, Flax and orbax up front."""
        if name not in _LAZY:
            raise AttributeError(f"module 'nnx_mpmd' has no attribute {name!r}")
        module_name, attribute = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: importing the ``nnx_mpmd.jit`` subpackage must not hide the
    function ``nnx_mpmd.jit`` (the import system sets a loaded subpackage on its parent)."""

    def __setattr__(self, name: str, value: Any) -> None:
        shadowed = _LAZY.get(name)
        if isinstance(value, types.ModuleType) and shadowed and shadowed[1] is not None:
            return  # the public name stays what _LAZY says; the subpackage is in sys.modules
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
