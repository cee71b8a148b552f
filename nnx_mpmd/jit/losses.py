"""How `value_and_grad` combines the microbatches' losses: mean, sum, or token mean.

The pipelined region always computes the mean over microbatches of the
loss, the aux values and the gradient (`nnx_mpmd.compiler.trace.region`). The other
reductions are built on it, with ordinary operations after the region that
the outer compiler places on every mesh:

* ``"mean"`` (default): the loss returns its microbatch's mean; the result is
  the mean of those means, ``(1/m) Σ L_i``, and its gradient. With equal
  microbatches of a per-example mean this is the full batch's mean.
* ``"sum"``: the loss returns its microbatch's *sum*; the result is ``Σ S_i``
  and ``Σ ∇S_i`` (the region's means times ``m``).
* ``"token_mean"``: the loss returns ``(sum, count)`` for its microbatch, e.g.
  the masked sum of per-token losses and the number of real tokens; the result
  is ``Σ S_i / Σ c_i`` and its gradient ``Σ ∇S_i / Σ c_i`` (the count is not
  differentiated). With padded, variable-length sequences this is the full
  batch's token-weighted mean, whatever the microbatches' token counts; the
  division happens once, after the region.

Aux values (``has_aux=True``) are averaged over the microbatches in every
mode, or concatenated where ``aux_reduction`` says (`nnx_mpmd.compiler.trace.region_aux`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.compiler.trace.region import (
    active_microbatches,
    reference_value_and_grad,
    trace_region,
)
from nnx_mpmd.errors import CompileError

__all__ = [
    "REDUCTIONS",
    "check_reduction",
    "combine",
    "region_loss",
    "value_and_grad",
    "batch_of_arguments",
    "wrt_from_argnums",
]

REDUCTIONS = ("mean", "sum", "token_mean")
"""The reductions `value_and_grad` accepts."""


def check_reduction(reduction: Any) -> str:
    """``reduction`` if it is one of `REDUCTIONS`, else a `CompileError` naming them.

    Example:
      >>> check_reduction("sum")
      'sum'
    """
    if reduction not in REDUCTIONS:
        raise CompileError(
            f"value_and_grad(reduction={reduction!r}) is not a reduction; use 'mean' (mean of "
            "the microbatches' mean losses), 'sum' (the loss returns a sum) or 'token_mean' "
            "(the loss returns (sum, count))."
        )
    return reduction


def _scalar(value: Any, what: str) -> Any:
    shape = jnp.shape(value)
    if shape != ():
        raise CompileError(
            f"value_and_grad(reduction='token_mean'): the loss's {what} has shape {shape}; "
            f"return a scalar {what}, e.g. (jnp.sum(mask * nll), jnp.sum(mask))."
        )
    return value


def region_loss(
    loss_fn: Callable[..., Any], reduction: str, has_aux: bool
) -> tuple[Callable[..., Any], bool]:
    """The loss function and ``has_aux`` the region traces for ``reduction``.

    For ``"token_mean"`` the region's loss is the microbatch's sum and its aux
    is ``(count, user aux)``; the other reductions trace ``loss_fn`` as it is.

    Args:
      loss_fn: the user's loss function.
      reduction: one of `REDUCTIONS`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``(function, has_aux)`` for the region.
    """
    if reduction != "token_mean":
        return loss_fn, has_aux

    def summed(model: Any, batch: Any) -> Any:
        out = loss_fn(model, batch)
        pair, aux = out if has_aux else (out, None)
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise CompileError(
                "value_and_grad(reduction='token_mean') needs the loss to return (sum, count) "
                f"for its microbatch{' and then aux' if has_aux else ''}, got "
                f"{type(pair).__name__}; e.g. return jnp.sum(mask * nll), jnp.sum(mask)."
            )
        total, count = _scalar(pair[0], "sum"), _scalar(pair[1], "count")
        return total, (jax.lax.stop_gradient(jnp.asarray(count, jnp.float32)), aux)

    return summed, True


def combine(out: Any, reduction: str, has_aux: bool, num_microbatches: int) -> Any:
    """The user's ``(loss, grads)`` (or ``((loss, aux), grads)``) from the region's means.

    Args:
      out: what the region returned for `region_loss`'s function.
      reduction: one of `REDUCTIONS`.
      has_aux: whether the user's loss has aux values.
      num_microbatches: ``m``.

    Returns:
      The reduced loss (and aux) and gradients.
    """
    if reduction == "mean":
        return out
    if reduction == "sum":
        (loss, aux), grads = out if has_aux else ((out[0], None), out[1])
        loss = loss * num_microbatches
        grads = jax.tree.map(lambda g: g * num_microbatches, grads)
        return ((loss, aux), grads) if has_aux else (loss, grads)
    (mean_sum, (mean_count, aux)), grads = out
    loss = mean_sum / mean_count  # the 1/m of both means cancels
    grads = jax.tree.map(lambda g: g / mean_count.astype(g.dtype), grads)
    return ((loss, aux), grads) if has_aux else (loss, grads)


def wrt_from_argnums(argnums: Any, wrt: Any) -> Any:
    """The Variable filter `value_and_grad` differentiates, from NNX's ``argnums``.

    ``argnums=0`` keeps ``wrt``; ``nnx.DiffState(0, filter)`` (the NNX way to
    differentiate a subset of the model) gives ``filter``. Anything else would
    differentiate the batch, which the pipelined region does not.

    Example:
      >>> from flax import nnx
      >>> wrt_from_argnums(nnx.DiffState(0, nnx.LoRAParam), nnx.Param).__name__
      'LoRAParam'
    """
    if isinstance(argnums, nnx.DiffState) and argnums.argnum == 0:
        if wrt is not nnx.Param:
            raise CompileError(
                f"value_and_grad got both wrt={wrt!r} and argnums={argnums!r}; give the "
                "filter once, as wrt=filter or argnums=nnx.DiffState(0, filter)."
            )
        return argnums.filter
    if isinstance(argnums, int) and not isinstance(argnums, bool) and argnums == 0:
        return wrt
    raise CompileError(
        f"value_and_grad(argnums={argnums!r}): the pipelined region differentiates the model "
        "(argument 0) only, with argnums=0 or argnums=nnx.DiffState(0, filter) (or "
        "wrt=filter). To differentiate an input, make it a Variable of the model (e.g. "
        "nnx.Param) and choose it with the filter."
    )


def batch_of_arguments(
    loss_fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Callable[..., Any]]:
    """The batch the region splits, and the loss function taking ``(model, batch)``.

    ``f(model, batch)`` keeps ``batch`` as it is. ``f(model, x, y)`` or
    ``f(model, x, labels=y)`` makes every argument after the model part of the
    batch: ``(x, y)`` (``(x, {"labels": y})`` with keywords), each leaf split
    along axis 0, and the loss is called with the microbatch's arguments.

    Raises:
      CompileError: no argument after the model (a loss that closes over its
        batch, which cannot be split into microbatches).

    Example:
      >>> batch, fn = batch_of_arguments(lambda m, x, y: x - y, (3.0, 1.0), {})
      >>> batch, fn(None, batch)
      ((3.0, 1.0), 2.0)
    """
    if len(args) == 1 and not kwargs:
        return args[0], loss_fn
    if not args and not kwargs:
        name = getattr(loss_fn, "__name__", "loss_fn")
        raise CompileError(
            f"value_and_grad({name})(model) got no batch: the arrays to split into "
            f"microbatches must be arguments, not values {name} closes over (those would "
            f"be whole in every microbatch). Write {name}(model, x, y) and call "
            f"mp.value_and_grad({name})(model, x, y), or pass one batch pytree."
        )
    if not kwargs:

        def positional(model: Any, batch: Any) -> Any:
            return loss_fn(model, *batch)

        return args, positional

    def with_keywords(model: Any, batch: Any) -> Any:
        return loss_fn(model, *batch[:-1], **batch[-1])

    return (*args, kwargs), with_keywords


def value_and_grad(
    loss_fn: Callable[..., Any] | None = None,
    has_aux: bool = False,
    *,
    argnums: int | nnx.DiffState = 0,
    wrt: Any = nnx.Param,
    num_microbatches: int | None = None,
    reduction: str = "mean",
    aux_reduction: Any = None,
) -> Callable[..., Any]:
    """Marks the pipelined region: the loss and gradient reduced over microbatches.

    ``value_and_grad(loss_fn)(model, batch)`` splits every leaf of ``batch``
    along axis 0 into microbatches and returns the mean loss and the mean
    gradient (an ``nnx.State`` like ``nnx.value_and_grad`` gives). Inside
    `jit` the region is pipelined with the step's schedule; outside it runs
    unpipelined with the same numbers, so one step works both ways.

    Every argument after the model is batch: ``value_and_grad(loss_fn)(model,
    x, y)`` calls ``loss_fn(model, x_i, y_i)`` per microbatch, like
    ``nnx.value_and_grad``. A loss that closes over its batch,
    ``value_and_grad(loss_fn)(model)``, is a `CompileError` (nothing to split).

    ``reduction`` says how the microbatches combine
    (`nnx_mpmd.jit.losses`): ``"mean"`` averages the microbatches' mean
    losses; ``"sum"`` adds the sums the loss returns; ``"token_mean"`` takes
    ``(sum, count)`` from the loss and returns ``Σ sum / Σ count`` with the
    gradient of that, the full batch's token-weighted mean however the real
    tokens fall into microbatches.

    Like ``nnx.value_and_grad``, it also works as a decorator
    (``@mp.value_and_grad(has_aux=True)``) and takes
    ``argnums=nnx.DiffState(0, filter)`` to differentiate a subset of the
    model's Variables (the same as ``wrt=filter``).

    Args:
      loss_fn: ``loss_fn(model, microbatch) -> loss`` (or ``(loss, aux)``;
        ``loss_fn(model, x, y)`` for several batch arguments); for
        ``reduction="token_mean"`` the loss is ``(sum, count)``. Leave it out
        to get a decorator.
      has_aux: whether ``loss_fn`` also returns aux values (combined over the
        microbatches as ``aux_reduction`` says, whatever the ``reduction``).
      argnums: ``0`` or ``nnx.DiffState(0, filter)``, as in
        ``nnx.value_and_grad``; only the model (argument 0) is differentiated.
      wrt: an NNX filter of the differentiated Variables (default ``nnx.Param``).
      num_microbatches: microbatches when run outside `jit` (default 1;
        inside `jit` the step's ``num_microbatches`` is used).
      reduction: ``"mean"``, ``"sum"`` or ``"token_mean"``.
      aux_reduction: how each aux leaf combines over the microbatches:
        ``"mean"`` (a summary such as an accuracy), ``"concat"`` (per-example
        values such as logits: the full batch's values in order, as
        ``nnx.value_and_grad`` on the full batch gives them), or a pytree
        prefix of the aux value with one of those per subtree. The default,
        None, averages every leaf but raises for a leaf whose leading axis
        has the microbatch's row count (it looks per-example).

    Returns:
      A function ``(model, *batch) -> (loss, grads)`` or ``((loss, aux), grads)``.

    Raises:
      CompileError: ``argnums`` other than the model, ``has_aux`` not a bool,
        no batch argument after the model,
        an unknown ``reduction`` or ``aux_reduction``, a
        ``"token_mean"`` loss that does not return a scalar ``(sum, count)``,
        or (default ``aux_reduction``) an aux leaf that looks per-example.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import nnx_mpmd as mp
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))}
      >>> loss, grads = mp.value_and_grad(loss_fn, num_microbatches=2)(model, batch)
      >>> grads["kernel"].shape
      (2, 1)
      >>> masked = lambda m, b: (jnp.sum(b["w"] * (m(b["x"]) - b["y"]) ** 2), jnp.sum(b["w"]))
      >>> batch["w"] = jnp.array([[1.0], [1.0], [1.0], [0.0]])  # the last row is padding
      >>> loss, _ = mp.value_and_grad(masked, num_microbatches=2, reduction="token_mean")(
      ...     model, batch)
      >>> bool(jnp.allclose(loss, masked(model, batch)[0] / 3))
      True
      >>> with_logits = lambda m, b: (jnp.mean((m(b["x"]) - b["y"]) ** 2), m(b["x"]))
      >>> (loss, logits), _ = mp.value_and_grad(
      ...     with_logits, has_aux=True, num_microbatches=2, aux_reduction="concat")(model, batch)
      >>> logits.shape  # the full batch's outputs, in order
      (4, 1)
    """
    if not isinstance(has_aux, bool):
        raise CompileError(
            f"value_and_grad(has_aux={has_aux!r}): has_aux is True or False; pass argnums "
            "by keyword (argnums=nnx.DiffState(0, filter))."
        )
    wrt = wrt_from_argnums(argnums, wrt)
    check_reduction(reduction)
    if loss_fn is None:
        return functools.partial(
            value_and_grad,
            has_aux=has_aux,
            wrt=wrt,
            num_microbatches=num_microbatches,
            reduction=reduction,
            aux_reduction=aux_reduction,
        )
    # The token mean's region aux is (count, the user's aux): the count is averaged.
    region_aux = ("mean", aux_reduction) if reduction == "token_mean" else aux_reduction

    def wrapped(model: Any, *args: Any, **kwargs: Any) -> Any:
        batch, per_call_fn = batch_of_arguments(loss_fn, args, kwargs)
        traced_fn, traced_aux = region_loss(per_call_fn, reduction, has_aux)
        active = active_microbatches()
        if active is not None:
            if num_microbatches not in (None, active):
                raise CompileError(
                    f"value_and_grad(num_microbatches={num_microbatches}) inside a step "
                    f"compiled with num_microbatches={active}; drop one of them."
                )
            out = trace_region(
                traced_fn, model, batch, has_aux=traced_aux, wrt=wrt, aux_reduction=region_aux
            )
            return combine(out, reduction, has_aux, active)
        count = num_microbatches or 1
        out = reference_value_and_grad(
            traced_fn,
            model,
            batch,
            num_microbatches=count,
            has_aux=traced_aux,
            wrt=wrt,
            aux_reduction=region_aux,
        )
        return combine(out, reduction, has_aux, count)

    return wrapped
