"""The opt-in NaN/inf check of ``mp.jit(..., check_finite=True)``.

Like JAX, a step passes NaN and inf through: an inf in the batch gives NaN
gradients and NaN parameters after the update, and nothing says where it came
from. With ``check_finite=True`` the step runs a `FiniteCheck` observer
(`nnx_mpmd.runtime.interpreter.Observer`): after every stage task it checks
the values the task made, in the order the step runs them:

* a forward's stage outputs (the activations sent to later stages);
* a backward's cotangents of its stage inputs (sent to the earlier stage);
* a backward's parameter gradients (the accumulators, named by parameter path).

The first non-finite value is remembered; the step still runs to its end (the
state it donated must be written back), then `NonFiniteError` names the stage,
the task and the value.

In a multi-process run each process checks the values it holds (the shards on
its own devices) of the tasks it runs; then the processes agree, through the
coordination service's key-value store, on the value found first in the
step's instruction order (`FiniteCheck.agree_across_processes`), and every
process raises the same error. Checking waits for each task, so a checked step is
slower; the compiled programs are the same with or without the check, and a
step without it runs no observer at all (no cost when off).

Example:
  >>> import jax.numpy as jnp
  >>> check = FiniteCheck(None)
  >>> check.first is None, bool(_all_finite([jnp.ones(2), jnp.array([1.0, jnp.inf])]))
  (True, False)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from nnx_mpmd.compiler.ir import Call, Instruction, slots_in
from nnx_mpmd.compiler.trace.stages import _input_kind
from nnx_mpmd.errors import NonFiniteError
from nnx_mpmd.runtime.interpreter import Observer

__all__ = ["FiniteCheck"]

# Per stage task kind: which part of the program's results holds what. Results
# follow `nnx_mpmd.compiler.trace.stage_programs.StageFunctions`: F -> (sends, kept,
# racc, carried); B -> (ct_xd, gacc); FB -> (sends, ct_xd, gacc, racc, carried);
# BI -> (ct_xd, extras); BW -> gacc; Fwd -> (sends, outputs, carried).
_PARTS: dict[str, tuple[tuple[Any, str], ...]] = {
    "F": ((0, "output"),),
    "Fwd": ((0, "output"),),
    "B": ((0, "input cotangent"), (1, "gradient")),
    "FB": ((0, "output"), (1, "input cotangent"), (2, "gradient")),
    "BI": ((0, "input cotangent"),),
    "BW": ((None, "gradient"),),
}


class FiniteCheck(Observer):
    """Finds the first non-finite stage output, input cotangent or gradient of a step.

    Args:
      step: the `nnx_mpmd.compiler.final.step.CompiledStep` (its stage plan names the
        gradients by parameter path); None names them by position only.

    Example:
      >>> FiniteCheck(None).raise_if_found()  # nothing found: nothing raised
    """

    def __init__(self, step: Any) -> None:
        self.plan = getattr(step, "plan", None)
        #: ``(stage, task label, what)`` of the first non-finite value, or None.
        self.first: tuple[int | None, str, str] | None = None
        self._index = -1  # its instruction's position in the step (the same on every process)

    def after(self, index: int, ins: Instruction, result: Any, store: list[Any]) -> None:
        if self.first is not None or not isinstance(ins, Call):
            return
        key = ins.program
        parts = _PARTS.get(key.kind)
        if parts is None or key.stage is None:
            return  # outer programs, accumulator inits, overlapped tasks: not stage values
        for position, role in parts:
            slots = ins.outs if position is None else ins.outs[position]
            values = [store[s] for s in slots_in(slots)]
            if _all_finite(values):
                continue
            bad = next(i for i, v in enumerate(values) if not _all_finite([v]))
            self.first = (key.stage, ins.label, self._name(key.stage, role, bad))
            self._index = index
            return

    def agree_across_processes(self) -> None:
        """Makes `first` the first non-finite value of any process (a collective).

        Found values go through the key-value store; the earliest instruction wins everywhere.

        Raises:
          DistributedError: a peer died or did not answer in time.
        """
        if jax.process_count() == 1:
            return
        from nnx_mpmd.runtime.coordination import get_coordination

        coordination = get_coordination()
        me, turn = jax.process_index(), next(_AGREEMENTS)
        mine = None if self.first is None else [self._index, *self.first]
        coordination.publish(f"finite/{turn}/{me}", mine)
        if turn >= 2:  # every peer has read it: this process read all of turn - 1
            coordination.delete(f"finite/{turn - 2}/{me}")
        where = "agreeing on the first non-finite value of the step (--check-finite)"
        found = [
            mine if peer == me else coordination.fetch(f"finite/{turn}/{peer}", peer, where)
            for peer in range(jax.process_count())
        ]
        candidates = [f for f in found if f is not None]
        if candidates:
            index, stage, label, what = min(candidates, key=lambda f: f[0])
            self._index, self.first = index, (stage, label, what)

    def _name(self, stage: int, role: str, position: int) -> str:
        if role == "gradient":
            paths = self._gradient_paths(stage)
            if position < len(paths):
                return f"the gradient of {paths[position]}"
            return f"parameter gradient {position}"
        return f"{role} {position}"

    def _gradient_paths(self, stage: int) -> list[str]:
        """The parameter paths of stage ``stage``'s gradient accumulators, in order."""
        if self.plan is None:
            return []
        info = self.plan.info
        paths = []
        for r in self.plan.stages[stage].region_inputs:
            kind, j = _input_kind(info, r)
            if kind == "diff":
                paths.append(info.diff_paths[j])
        return paths

    def raise_if_found(self) -> None:
        """Raises `NonFiniteError` for the first non-finite value found, if any.

        Raises:
          NonFiniteError: a stage task made NaN or inf.
        """
        if self.first is None:
            return
        stage, label, what = self.first
        raise NonFiniteError(
            f"stage {stage}'s task {label} made a non-finite value (NaN or inf) first: {what}. "
            "The step ran to its end and its update was applied, so the parameters may hold "
            "NaN now: restore the last checkpoint. Look for the cause in that stage's layers "
            "and in the batch (inf or NaN inputs, a learning rate too high, an overflowing "
            "dtype)."
        )


def _all_finite(values: Sequence[Any]) -> bool:
    """Whether every inexact array leaf of ``values`` holds only finite numbers.

    A leaf that cannot be checked eagerly (an unreduced partial sum, say) counts
    as finite: the check names what it can see and never fails a good step.
    """
    for leaf in jax.tree.leaves(values):
        if not (hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)):
            continue
        # A global array of a multi-process run: only the shards on this process's devices.
        local = isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        parts = [shard.data for shard in leaf.addressable_shards] if local else [leaf]
        for part in parts:
            try:
                finite = bool(jnp.isfinite(part).all())
            except Exception:  # not checkable outside a program
                continue
            if not finite:
                return False
    return True


_AGREEMENTS = itertools.count()
