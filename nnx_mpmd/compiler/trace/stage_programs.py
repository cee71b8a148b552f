"""The programs a stage runs: forward, backward, fused forward+backward, init.

For stage ``k`` the forward task evaluates the stage's slice on one microbatch
and returns the values later stages need plus the residuals of ``jax.vjp`` (a
pytree that crosses the ``jit`` boundary). The backward task feeds the
residuals the output cotangents and adds the parameter gradient into a donated
accumulator. On the last stage, a forward directly followed by its backward
fuses into one program that keeps no residuals.

Stage code is traced against the submeshes' abstract mesh (`submesh_tracing`):
every submesh has the same axis names, sizes and axis types (Explicit or Auto,
as the user's mesh has them, without the mpmd axis), so ``jax.sharding.reshard``,
``out_sharding=`` and ``with_sharding_constraint`` inside a stage resolve a
``PartitionSpec`` against the submesh a stage program then runs on.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.core import ShapedArray
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_mpmd.compiler.jaxpr_utils import structure_key
from nnx_mpmd.compiler.trace.grad_reduction import GradientReduction, run_deferring
from nnx_mpmd.compiler.trace.grad_reduction_auto import StackedReduction, run_stacking
from nnx_mpmd.compiler.trace.region import RegionInfo
from nnx_mpmd.compiler.trace.region_aux import stacked_aval, stacked_spec, value_spec
from nnx_mpmd.compiler.trace.split_backward import abstract_like, run_bi, run_bw
from nnx_mpmd.compiler.trace.stages import StagePlan, _input_kind
from nnx_mpmd.errors import MeshError
from nnx_mpmd.placement.mesh import MpmdMesh

__all__ = [
    "STAGE_PROGRAMS",
    "StageFunctions",
    "check_mesh_context",
    "mean_dtype",
    "submesh_tracing",
]

# Per stage task kind: the `StageFunctions` method it runs, and the arguments it
# always donates (accumulators).
STAGE_PROGRAMS: dict[str, tuple[str, tuple[int, ...]]] = {
    "F": ("forward", (6,)),
    "B": ("backward", (3,)),
    "FB": ("fused", (7, 8)),
    "BI": ("backward_input", ()),
    "Fwd": ("forward_only", ()),
    "BW": ("backward_weight", (3,)),
}


def check_mesh_context(mesh: MpmdMesh | Sequence[Mesh]) -> None:
    """Raises if a JAX mesh context would conflict with the stage programs.

    A concrete mesh would pin every stage program; an abstract mesh equal to the submeshes' is fine.

    Raises:
      MeshError: a concrete mesh is set, or the abstract mesh differs from the submeshes'.

    Example:
      >>> import jax
      >>> from nnx_mpmd.placement.mesh import MpmdMesh
      >>> mesh = MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")
      >>> check_mesh_context(mesh)  # no mesh context: fine
    """
    concrete = jax.sharding.get_mesh()
    abstract = jax.sharding.get_abstract_mesh()
    submeshes = mesh.submeshes if isinstance(mesh, MpmdMesh) else mesh
    expected = submeshes[0].abstract_mesh
    if concrete.empty and (abstract.empty or abstract == expected):
        return
    current = abstract if concrete.empty else concrete.abstract_mesh
    raise MeshError(
        f"a pipelined step was called under the mesh context {current} (jax.set_mesh or "
        f"jax.sharding.use_abstract_mesh), but its stages run on {len(submeshes)} submeshes "
        f"whose abstract mesh is {expected}. mp.jit gives each stage its submesh itself: "
        "call the step outside the `with jax.set_mesh(...)` block (build the model under it "
        "if its parameters need eager sharding)."
    )


def _names_mpmd_axis(error: Exception, mpmd_axis: str) -> bool:
    text = str(error)
    axis = re.escape(mpmd_axis)
    return bool(
        re.search(rf"Resource axis: {axis} of ", text)
        or re.search(rf"AbstractMesh\(.*'{axis}': \d", text)
        or re.search(rf"Mesh\(.*'{axis}': \d", text)
    )


@contextlib.contextmanager
def submesh_tracing(mesh: MpmdMesh) -> Iterator[None]:
    """Traces step code on the submeshes' abstract mesh (the user's axes, no mpmd axis).

    So specs in ``reshard`` or ``out_sharding=`` name submesh axes, as under ``jax.set_mesh``.

    Raises:
      MeshError: a conflicting mesh context is active, or the traced code shards
        over the mpmd axis (or the whole MpmdMesh).

    Example:
      >>> import jax
      >>> from nnx_mpmd.placement.mesh import MpmdMesh
      >>> mesh = MpmdMesh(jax.make_mesh((2, 4), ("stage", "data")), "stage")
      >>> with submesh_tracing(mesh):
      ...     print(jax.sharding.get_abstract_mesh().axis_names)
      ('data',)
    """
    check_mesh_context(mesh)
    try:
        with jax.sharding.use_abstract_mesh(mesh.submesh(0).abstract_mesh):
            yield
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        if not _names_mpmd_axis(e, mesh.mpmd_axis):
            raise
        raise MeshError(
            f"code inside the pipelined step shards over the mpmd axis {mesh.mpmd_axis!r} "
            f"(reshard, out_sharding=, with_sharding_constraint or a NamedSharding of the "
            f"whole mesh): {e}. That axis enumerates the pipeline submeshes and does not "
            f"exist inside a stage, whose mesh has the axes {mesh.axis_names}. Name only "
            "those axes (a PartitionSpec resolves against the stage's submesh); activations "
            "move between stages by the schedule, not by resharding."
        ) from e


def mean_dtype(dtype: Any) -> Any:
    """The dtype of a microbatch mean: integers average to float32."""
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float32


def _stacked_zeros(aval: Any, num_microbatches: int) -> Any:
    """Zeros for ``num_microbatches`` values of ``aval``, sharded like each one."""
    stacked = stacked_aval(aval, num_microbatches)
    explicit = stacked_spec(aval) is not None
    return jnp.zeros(
        stacked.shape, stacked.dtype, out_sharding=stacked.sharding if explicit else None
    )


def _mean_zeros(aval: Any) -> Any:
    """A zero mean accumulator for values of ``aval``, sharded like each one.

    Else on Explicit axes the sum's type changes (recompiled, donated accumulator unusable).
    """
    explicit = value_spec(aval) is not None
    return jnp.zeros(
        aval.shape, mean_dtype(aval.dtype), out_sharding=aval.sharding if explicit else None
    )


def _stack_into(buffer: Any, value: Any, idx: Any) -> Any:
    """``buffer`` with ``value`` as its row ``idx``.

    On Explicit axes the update must have the buffer's sharding. The buffer
    is made sharded like the values (`region_plan`'s init), so this reshards
    only a value whose type differs from the one traced for it.
    """
    value = value.astype(buffer.dtype)
    want = getattr(jax.typeof(buffer).sharding, "spec", None)
    have = jax.typeof(value).sharding
    if want is not None and tuple(want[1:]) != tuple(getattr(have, "spec", ())):
        value = jax.sharding.reshard(value, NamedSharding(have.mesh, PartitionSpec(*want[1:])))
    return lax.dynamic_update_index_in_dim(buffer, value, idx, 0)


def _type_key(aval: Any) -> tuple[str, ...]:
    """An aval's type as comparable text: shape, dtype, weak type, sharding."""
    sharding = getattr(aval, "sharding", None)
    return (str(aval.shape), str(aval.dtype), str(aval.weak_type), str(sharding))


def _inexact(v: Any) -> bool:
    return bool(jnp.issubdtype(v.aval.dtype, jnp.inexact))


class StageFunctions:
    """Pure functions (not yet jitted) for one stage, plus their interface.

    Inputs are grouped as: ``params`` (differentiated region inputs),
    ``rest`` (closure values and other state), ``batch`` (full batches shaped
    ``[m, B/m, ...]``), ``idx`` (the microbatch index), ``xd``/``xn``
    (differentiable / non-differentiable boundary inputs).
    """

    def __init__(
        self, plan: StagePlan, stage: int, residual_layouts: dict[Any, Any] | None = None
    ) -> None:
        info: RegionInfo = plan.info
        # The layout of the forward's residuals, by `structure`: shared by equal
        # stages, since one's backward may run after only the other's forward was traced.
        self._residual_layouts = {} if residual_layouts is None else residual_layouts
        self.plan = plan
        self.stage = stage
        self.slice = sl = plan.stages[stage]
        self.m = info.num_microbatches
        self.input_kinds = kinds = [_input_kind(info, r)[0] for r in sl.region_inputs]
        self.param_inputs = [r for r, k in zip(sl.region_inputs, kinds) if k == "diff"]
        self.rest_inputs = [r for r, k in zip(sl.region_inputs, kinds) if k in ("closure", "other")]
        self.batch_inputs = [r for r, k in zip(sl.region_inputs, kinds) if k == "batch"]
        self.xd = [v for v in sl.boundary_in if _inexact(v)]
        self.xn = [v for v in sl.boundary_in if not _inexact(v)]
        self.sends = [v for v in sl.boundary_out if v in plan.consumers]
        loss_var = plan.outputs[0].var if plan.outputs[0].kind == "stage" else None
        self.loss_var = loss_var if loss_var in sl.boundary_out and info.with_grad else None
        # Differentiated outputs: float values sent to later stages, and the loss.
        self.yd = [v for v in self.sends if _inexact(v)]
        if self.loss_var is not None and self.loss_var not in self.yd:
            self.yd.append(self.loss_var)
        self.yn = [v for v in sl.boundary_out if v not in self.yd]
        # Non-parameter state this stage updates (RNG counters, batch statistics):
        # each forward takes the value left by the previous microbatch's forward.
        first_other = info.n_closure + info.n_diff
        self.carries: dict[int, Any] = {}
        for j, source in enumerate(plan.outputs[1 + info.n_aux :]):
            if source.kind == "stage" and source.stage == stage:
                self.carries[first_other + j] = source.var
        # Region outputs produced here (loss, aux) are averaged over microbatches,
        # or stacked per microbatch for a "concat" aux leaf (`region_aux`);
        # forward-only steps collect them instead.
        produced = [
            (o.var, index)
            for index, o in enumerate(plan.outputs[: 1 + info.n_aux])
            if o.kind == "stage" and o.stage == stage
        ]
        self.accumulated = [var for var, _ in produced]
        # The region output each accumulator is (the loss may also be an aux value).
        self.accumulated_outputs = [index for _, index in produced]
        modes = ("mean", *getattr(info, "aux_modes", ()))
        self.stacked_results = tuple(
            index < len(modes) and modes[index] == "concat" for _, index in produced
        )
        # Data parallelism on an Explicit axis: gradients accumulate unreduced over it.
        axis = getattr(info, "unreduced_axis", None)
        self.reduction = GradientReduction(axis) if axis is not None else None
        # On an Auto axis: as stacked per-device partials (`grad_reduction_auto`).
        stacked = getattr(info, "stacked_axis", None) if info.with_grad else None
        if stacked is not None:
            self.reduction = StackedReduction(*stacked)
        self.result_specs = self._result_specs()

    # -- equal stages ----------------------------------------------------------
    @functools.cached_property
    def _structure(self) -> tuple[Any, ...] | None:
        sl = self.slice
        key = structure_key(sl.program.eqns, sl.program.invars, sl.program.outvars)
        if key is None:
            return None
        try:
            interface = self._interface()
            hash(interface)
        except (KeyError, TypeError):  # an output it does not return, a policy without ==
            return None
        return (key, interface)

    def _interface(self) -> tuple[Any, ...]:
        """What the programs read besides the stage's equations, by position."""
        sl, info = self.slice, self.plan.info
        out = {v: i for i, v in enumerate(sl.boundary_out)}
        region = {r: i for i, r in enumerate(sl.region_inputs)}
        return (
            tuple(self.input_kinds),
            tuple(_inexact(v) for v in sl.boundary_in),
            tuple(out[v] for v in self.sends),
            tuple(out[v] for v in self.yd),
            tuple(out[v] for v in self.yn),
            None if self.loss_var is None else out[self.loss_var],
            # state this stage updates: the input it replaces (if it reads it), the output
            tuple((region.get(r), out[v]) for r, v in self.carries.items()),
            tuple(out[v] for v in self.accumulated),
            self.stacked_results,
            (
                self.m,
                info.with_grad,
                getattr(info, "unreduced_axis", None),
                getattr(info, "stacked_axis", None),
            ),
            (sl.remat, sl.policy),
        )

    def structure(self, kind: str) -> tuple[Any, ...] | None:
        """A key of this stage's ``kind`` program (None: unique); twins share one executable."""
        return None if self._structure is None else (kind, *self._structure)

    # -- helpers -----------------------------------------------------------
    def _program_args(self, params, rest, mb, xd, xn) -> list[Any]:
        by_region = dict(zip(self.param_inputs, params))
        by_region.update(zip(self.rest_inputs, rest))
        by_region.update(zip(self.batch_inputs, mb))
        by_boundary = dict(zip(self.xd, xd))
        by_boundary.update(zip(self.xn, xn))
        return [by_region[r] for r in self.slice.region_inputs] + [
            by_boundary[v] for v in self.slice.boundary_in
        ]

    def _forward(self, params, rest, batch, idx, xd, xn):
        mb = [lax.dynamic_index_in_dim(b, idx, 0, keepdims=False) for b in batch]

        def f(params, xd):
            outs = dict(
                zip(
                    self.slice.boundary_out,
                    self.slice.program(*self._program_args(params, rest, mb, xd, xn)),
                )
            )
            return tuple(outs[v] for v in self.yd), tuple(outs[v] for v in self.yn)

        if self.slice.remat:
            f = jax.checkpoint(f, policy=self.slice.policy)
        yd, vjp_fn, yn = jax.vjp(f, tuple(params), tuple(xd), has_aux=True)
        values = dict(zip(self.yd, yd))
        values.update(zip(self.yn, yn))
        return values, vjp_fn

    def _result_specs(self) -> tuple[PartitionSpec | None, ...]:
        """Each result accumulator's layout: its init makes it, its programs keep it.

        On Explicit axes it is the values' type (a stacked buffer: per row). On
        an Auto batch axis XLA would choose the updated accumulator's layout,
        which can differ from its zeros' (the last stage's programs would
        compile again, their donation unusable): rows over the axis instead.
        """
        red = self.reduction
        auto = red if isinstance(red, StackedReduction) else None
        specs = []
        for v, stacked in zip(self.accumulated, self.stacked_results):
            if auto is None:
                specs.append(stacked_spec(v.aval) if stacked else value_spec(v.aval))
            else:
                rows = auto.rows_spec(v.aval.shape)
                specs.append(PartitionSpec(None, *rows) if stacked else rows)
        return tuple(specs)

    def _accumulate(self, values, racc, idx):
        """The result accumulators after microbatch ``idx``: means, or stacked values."""
        scale = 1.0 / self.m
        new = tuple(
            _stack_into(a, values[v], idx) if stacked else a + (values[v] * scale).astype(a.dtype)
            for a, v, stacked in zip(racc, self.accumulated, self.stacked_results)
        )
        if not isinstance(self.reduction, StackedReduction):
            return new  # typed: each sum has its accumulator's type
        specs = cast(tuple[PartitionSpec, ...], self.result_specs)  # stacked: each has one
        return tuple(self.reduction.constrain(a, s) for a, s in zip(new, specs))

    def _add_grads(self, gacc, grads):
        """``gacc + grads``; an unreduced accumulator takes its gradient unreduced.

        A deferred gradient arrives typed as its accumulator (for an FSDP
        parameter: full size, unreduced); any other is made so first. Stacked
        partials (`grad_reduction_auto`) arrive as `run_stacking` gave them.
        """
        red = self.reduction
        if red is not None and not isinstance(red, StackedReduction):
            grads = [
                red.unreduced_like(g, a) if red.is_unreduced(a) else red.reduce(g, like=a)
                for a, g in zip(gacc, grads)
            ]
        return tuple(a + g.astype(a.dtype) for a, g in zip(gacc, grads))

    def _backward(self, vjp_fn, cts, gacc, xd):
        seeds = tuple(self._seeds(cts))
        if self.reduction is None:
            g_params, ct_xd = vjp_fn(seeds)
        elif isinstance(self.reduction, StackedReduction):
            g_params, ct_xd = run_stacking(
                vjp_fn, seeds, reduction=self.reduction, stacked=self._stacked(gacc)
            )
        else:  # weight gradients stay unreduced over the data axis (see grad_reduction)
            g_params, ct_xd = run_deferring(vjp_fn, seeds, reduction=self.reduction)
            # Input cotangents are reduced here (to a data-sharded input's own type).
            red = self.reduction
            ct_xd = tuple(
                red.reduce(c, like=x if red.sharded_over(x) else None) for c, x in zip(ct_xd, xd)
            )
        return ct_xd, self._add_grads(gacc, g_params)

    # -- residuals -------------------------------------------------------------
    # jax.vjp's residuals include the task's own inputs (parameters, the stage
    # input). Returning them from the forward program would copy them once per
    # microbatch, so the forward keeps only the other residuals and the backward
    # rebuilds the vjp function from its own copies of the inputs.
    def _pack(self, vjp_fn, inputs):
        leaves, tree = jax.tree.flatten(vjp_fn)
        position = {id(x): i for i, x in enumerate(jax.tree.leaves(inputs))}
        layout = tuple(position.get(id(leaf), -1) for leaf in leaves)
        self._residual_layouts[self._layout_key] = (tree, layout)
        return tuple(leaf for leaf, pos in zip(leaves, layout) if pos < 0)

    @property
    def _layout_key(self) -> Any:
        return ("stage", self.stage) if self._structure is None else self._structure

    def _unpack(self, kept, inputs):
        if self._layout_key not in self._residual_layouts:
            # No forward of this stage (or an equal one) was traced: trace it for the layout.
            jax.eval_shape(lambda *a: self._pack(self._forward(*a)[1], a), *inputs)
        tree, layout = self._residual_layouts[self._layout_key]
        flat_inputs = jax.tree.leaves(inputs)
        kept_iter = iter(kept)
        leaves = [flat_inputs[pos] if pos >= 0 else next(kept_iter) for pos in layout]
        return jax.tree.unflatten(tree, leaves)

    # -- the programs --------------------------------------------------------
    def _carried(self, values):
        return tuple(values[v] for v in self.carries.values())

    def forward(self, params, rest, batch, idx, xd, xn, racc):
        """-> (sends, kept residuals, racc', carried state)."""
        inputs = (params, rest, batch, idx, xd, xn)
        values, vjp_fn = self._forward(*inputs)
        kept = self._pack(vjp_fn, inputs)
        sends = tuple(values[v] for v in self.sends)
        return sends, kept, self._accumulate(values, racc, idx), self._carried(values)

    def forward_only(self, params, rest, batch, idx, xd, xn):
        """Inference: -> (sends, this microbatch's outputs, carried state)."""
        mb = [lax.dynamic_index_in_dim(b, idx, 0, keepdims=False) for b in batch]
        args = self._program_args(params, rest, mb, xd, xn)
        values = dict(zip(self.slice.boundary_out, self.slice.program(*args)))
        outputs = tuple(values[v] for v in self.accumulated)
        return tuple(values[v] for v in self.sends), outputs, self._carried(values)

    def backward(self, kept, inputs, cts, gacc):
        """``(ct_xd, gacc')`` from the forward's inputs and the differentiated sends' cotangents."""
        return self._backward(self._unpack(kept, inputs), cts, gacc, inputs[4])

    def fused(self, params, rest, batch, idx, xd, xn, cts, gacc, racc):
        """Forward and backward of one microbatch.

        Returns ``(sends, ct_xd, gacc', racc', carried state)``.
        """
        values, vjp_fn = self._forward(params, rest, batch, idx, xd, xn)
        ct_xd, gacc = self._backward(vjp_fn, cts, gacc, xd)
        sends = tuple(values[v] for v in self.sends)
        return sends, ct_xd, gacc, self._accumulate(values, racc, idx), self._carried(values)

    def _differentiated_sends(self, values):
        """The forward's differentiated outputs, from one trace (not one per output)."""
        return tuple(values[v] for v in self.yd)

    def _seeds(self, cts):
        seeds = []
        ct_iter = iter(cts)
        for v in self.yd:
            if v is self.loss_var:
                seeds.append(jnp.full(v.aval.shape, 1.0 / self.m, v.aval.dtype))
            else:
                seeds.append(functools.reduce(jnp.add, next(ct_iter)))
        return seeds

    def backward_input(self, kept, inputs, cts):
        """The BI task. -> (ct_xd, extras for BW)."""
        return run_bi(self._unpack(kept, inputs), self._seeds(cts), len(self.param_inputs))

    def backward_weight(self, kept, inputs, extras, gacc):
        """The BW task. -> gacc'."""
        # The cotangents' types are the forward outputs' types for these inputs
        # (shardings included: on Explicit axes they are part of the type).
        outputs = jax.eval_shape(
            lambda *a: self._differentiated_sends(self._forward(*a)[0]), *inputs
        )
        seed_avals = [abstract_like(o) for o in outputs]
        vjp_fn = self._unpack(kept, inputs)
        n = len(self.param_inputs)
        bw = lambda vjp_fn, extras: run_bw(vjp_fn, extras, seed_avals, n)  # noqa: E731
        if self.reduction is None:
            grads = bw(vjp_fn, extras)
        elif isinstance(self.reduction, StackedReduction):
            stacked = self._stacked(gacc)
            grads = run_stacking(bw, vjp_fn, extras, reduction=self.reduction, stacked=stacked)
        else:
            grads = run_deferring(bw, vjp_fn, extras, reduction=self.reduction)
        return self._add_grads(gacc, grads)

    def init(self, params, stacked=()):
        """Zero accumulators: (gacc, racc); unreduced where `GradientReduction.defers` says.

        An unreduced accumulator of an FSDP parameter (sharded over the data
        axis) has the parameter's full size on every device of the axis.
        ``stacked``: per parameter, whether its accumulator is stacked partials
        (`StackedReduction.defers` of the concrete parameter, decided by the caller).
        """
        red = self.reduction
        if isinstance(red, StackedReduction):
            gacc = tuple(
                red.zeros(p) if s else jnp.zeros_like(p)
                for p, s in zip(params, stacked or (False,) * len(params))
            )
        else:
            gacc = tuple(
                red.zeros_like(p) if red and red.defers(p) else jnp.zeros_like(p) for p in params
            )
        return gacc, self.zero_results()

    def zero_results(self):
        """The zero loss/aux accumulators ``init`` makes: means, or stacked-value buffers."""
        return tuple(
            _stacked_zeros(v.aval, self.m) if stacked else _mean_zeros(v.aval)
            for v, stacked in zip(self.accumulated, self.stacked_results)
        )

    def reduce(self, gacc, params):
        """The ``reduce`` task, once per step after the last backward: gacc reduced.

        Each accumulator is reduced to its parameter's sharding (``params``
        are read for their types): an all-reduce, or for a parameter sharded
        over the data axis (FSDP) a reduce-scatter.
        """
        if self.reduction is None:
            return tuple(gacc)
        if isinstance(self.reduction, StackedReduction):
            stacked = set(self._stacked(gacc))
            return tuple(
                self.reduction.reduce(a) if i in stacked else a for i, a in enumerate(gacc)
            )
        return tuple(self.reduction.reduce(a, like=p) for a, p in zip(gacc, params))

    def _stacked(self, gacc) -> list[int]:
        """Positions of the stacked accumulators: one dimension more than their parameter."""
        body = self.plan.info.body
        return [
            i
            for i, (a, r) in enumerate(zip(gacc, self.param_inputs))
            if jnp.ndim(a) == len(cast(ShapedArray, body.invars[r].aval).shape) + 1
        ]

    @property
    def diff_sends(self) -> list[Any]:
        return [v for v in self.yd if v is not self.loss_var]

    def cotangents_fit_inputs(self) -> bool:
        """Whether received cotangents have the input cotangents' types (so they can be donated)."""
        sends = sorted(_type_key(v.aval) for v in self.diff_sends)
        return bool(sends) and sends == sorted(_type_key(v.aval) for v in self.xd)
