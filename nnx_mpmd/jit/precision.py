"""Mixed precision for any NNX model: compute in one dtype, keep master weights in another.

Flax modules take two dtypes: ``param_dtype`` (how a parameter is stored) and
``dtype`` (what the layer computes in; it casts its parameters at use). That
works for models written with those arguments. `Precision` applies the same
split from outside the model, to any NNX model, the way ``jmp``-style policies
do in JAX: the loss function sees a model whose floating-point ``nnx.Param``
values are cast to ``compute_dtype`` (and floating-point batch leaves too),
while the Variables that the optimizer updates stay in ``param_dtype``. The cast
is part of the differentiated function, so gradients come back in the master
dtype, and so does the optimizer state built from the master parameters. `Precision.apply_to` sets
the compute dtype of the model's Flax layers, which otherwise cast back to the
dtype they were built with (``nnx.Embed`` fixes its dtype at construction). The
loss (and aux values) are cast to ``output_dtype`` (float32) before the
microbatches are reduced.

Under `nnx_mpmd.jit` the casts are glue code on parameters: each one runs on the
stage that first uses the parameter, so a stage casts its own weights. Under
``nnx.jit`` (or eagerly) the same wrapped loss gives the same numbers.

Example:
  >>> import jax.numpy as jnp
  >>> import optax
  >>> from flax import nnx
  >>> import nnx_mpmd as mp
  >>> policy = mp.Precision(compute_dtype=jnp.bfloat16)
  >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  >>> policy.apply_to(model)  # before the optimizer: its state takes the param dtype
  >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  >>> def loss_fn(model, batch):
  ...     return jnp.mean(policy.cast_to_output(model(batch["x"])) ** 2)
  >>> loss, grads = mp.value_and_grad(policy.wrap(loss_fn))(model, {"x": jnp.ones((2, 4))})
  >>> loss.dtype, grads["kernel"].dtype
  (dtype('float32'), dtype('float32'))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_mpmd.errors import MpmdError

__all__ = ["DTYPE_NAMES", "Precision", "precision_from_names"]

#: The dtype names ``nnx-mpmd train --dtype`` and ``--param-dtype`` accept.
DTYPE_NAMES = ("float32", "bfloat16")


def _floating_dtype(value: Any, field: str) -> jnp.dtype:
    """``value`` as a floating-point ``jnp.dtype``, or an `MpmdError` naming ``field``."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise MpmdError(
            f"Precision({field}={value!r}): not a floating-point dtype; use a float dtype "
            "such as jnp.float32, jnp.bfloat16 or jnp.float16."
        )
    return dtype


def _cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Every floating-point array leaf of ``tree`` cast to ``dtype``; other leaves as they are."""

    def cast(leaf: Any) -> Any:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.asarray(leaf).astype(dtype)
        return leaf

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy: compute dtype, master-parameter dtype, output dtype.

    ``Precision(compute_dtype=jnp.bfloat16)`` is the usual bf16 recipe: float32
    parameters and optimizer state, bf16 matmuls, a float32 loss. Apply it to a
    model once with `apply_to` (before building the optimizer, so the
    optimizer state takes the master dtype) and to the loss function with
    `wrap` inside the train step; the same step compiles under `nnx_mpmd.jit`
    and ``nnx.jit`` alike.

    Flax layers cast their inputs and weights to their own ``dtype`` at use
    (``nnx.Embed`` fixes it to float32 when built with the default); `apply_to`
    sets it to ``compute_dtype`` on every layer of the model, so the two agree.

    Args:
      compute_dtype: the dtype the forward and backward passes compute in.
      param_dtype: the dtype parameters (and the optimizer state built from
        them) are stored and updated in.
      output_dtype: the dtype of the loss and aux values the wrapped loss
        returns (float32: the microbatch reduction and the loss stay exact).

    Raises:
      MpmdError: a dtype that is not a floating-point dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> policy = Precision(compute_dtype=jnp.bfloat16)
      >>> policy.cast_to_compute({"x": jnp.ones(2), "ids": jnp.zeros(2, jnp.int32)})["x"].dtype
      dtype(bfloat16)
      >>> policy.is_mixed
      True
    """

    compute_dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for field in ("compute_dtype", "param_dtype", "output_dtype"):
            object.__setattr__(self, field, _floating_dtype(getattr(self, field), field))

    @property
    def is_mixed(self) -> bool:
        """Whether any dtype differs from float32 (False: the policy changes nothing)."""
        return any(
            d != jnp.float32 for d in (self.compute_dtype, self.param_dtype, self.output_dtype)
        )

    def cast_to_compute(self, tree: Any) -> Any:
        """``tree`` with its floating-point leaves in ``compute_dtype`` (integers untouched).

        Example:
          >>> Precision(compute_dtype="bfloat16").cast_to_compute(jnp.ones(2)).dtype
          dtype(bfloat16)
        """
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """``tree`` with its floating-point leaves in ``param_dtype``.

        Example:
          >>> Precision(param_dtype="bfloat16").cast_to_param(jnp.ones(2)).dtype
          dtype(bfloat16)
        """
        return _cast_floating(tree, self.param_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """``tree`` with its floating-point leaves in ``output_dtype``: use it on the logits
        before a softmax cross-entropy, so the loss is computed in float32.

        Example:
          >>> Precision(compute_dtype="bfloat16").cast_to_output(jnp.ones(2, "bfloat16")).dtype
          dtype('float32')
        """
        return _cast_floating(tree, self.output_dtype)

    def apply_to(self, model: Any, wrt: Any = nnx.Param) -> None:
        """Makes ``model`` follow the policy, in place, as if its layers had been built
        with ``dtype=compute_dtype, param_dtype=param_dtype``. Call it once, before
        building the optimizer (whose state then takes the parameters' dtype) and
        before the first step compiles.

        Every module that holds a ``dtype`` attribute (Flax's layers: ``nnx.Linear``,
        ``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.Conv``, ...; the model zoo's layers)
        gets ``compute_dtype``, and its ``param_dtype`` attribute, if any,
        ``param_dtype``; the floating-point Variables ``wrt`` selects are
        converted to ``param_dtype``. Such layers cast their weights at use, so
        the stored weights stay in the master dtype.

        Args:
          model: an NNX module (or any graph node).
          wrt: an NNX filter of the Variables to store in ``param_dtype``
            (default ``nnx.Param``).

        Example:
          >>> from flax import nnx
          >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
          >>> Precision(compute_dtype="bfloat16").apply_to(layer)
          >>> layer.dtype, layer.kernel[...].dtype
          (dtype(bfloat16), dtype('float32'))
        """
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module):
                self._set_layer_dtypes(node)
        for variable in _floating_variables(model, wrt):
            variable.set_value(variable.get_value().astype(self.param_dtype))

    def _set_layer_dtypes(self, module: nnx.Module) -> None:
        """Sets ``module``'s own ``dtype`` / ``param_dtype`` attributes (a float dtype or None);
        attributes it only forwards (`nnx_mpmd.Stage`) or that hold another kind are left."""
        own = vars(module)
        for name, dtype in (("dtype", self.compute_dtype), ("param_dtype", self.param_dtype)):
            value = own.get(name, False)
            if value is None or (value is not False and _is_floating_dtype(value)):
                setattr(module, name, dtype)

    @contextlib.contextmanager
    def computing(self, model: Any, wrt: Any = nnx.Param) -> Iterator[Any]:
        """Within the block, ``model``'s floating-point ``wrt`` Variables hold their values
        cast to ``compute_dtype``; on exit they hold the master values again.

        Used by `wrap`; inside a differentiated function the cast is part of
        what is differentiated, so gradients reach the master values.

        Args:
          model: the NNX module the loss function receives.
          wrt: an NNX filter of the Variables to cast (default ``nnx.Param``).

        Returns:
          A context manager that yields ``model``.

        Example:
          >>> from flax import nnx
          >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
          >>> with Precision(compute_dtype="bfloat16").computing(layer):
          ...     layer.kernel[...].dtype
          dtype(bfloat16)
          >>> layer.kernel[...].dtype
          dtype('float32')
        """
        variables = _floating_variables(model, wrt)
        masters = [v.get_value() for v in variables]
        for variable, master in zip(variables, masters, strict=True):
            variable.set_value(master.astype(self.compute_dtype))
        try:
            yield model
        finally:
            for variable, master in zip(variables, masters, strict=True):
                variable.set_value(master)

    def wrap(
        self, loss_fn: Callable[..., Any], *, wrt: Any = nnx.Param, cast_inputs: bool = True
    ) -> Callable[..., Any]:
        """``loss_fn`` computed under this policy, for `nnx_mpmd.value_and_grad` (or
        ``nnx.value_and_grad``).

        The wrapped function calls ``loss_fn(model, *batch)`` with the model's
        parameters (and, with ``cast_inputs``, the batch's floating-point
        leaves) in ``compute_dtype``, and returns its result with the
        floating-point leaves in ``output_dtype``.

        Args:
          loss_fn: ``loss_fn(model, *batch) -> loss`` (or ``(loss, aux)``).
          wrt: an NNX filter of the Variables cast to the compute dtype; use the
            same filter as the ``value_and_grad`` that differentiates them.
          cast_inputs: also cast floating-point batch leaves (integer token
            ids are never cast).

        Returns:
          The wrapped loss function, with the same signature.

        Example:
          >>> import jax.numpy as jnp
          >>> from flax import nnx
          >>> policy = Precision(compute_dtype=jnp.bfloat16)
          >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
          >>> dtype_seen = policy.wrap(lambda m, x: m(x).dtype)
          >>> dtype_seen(layer, jnp.ones((1, 2)))
          dtype(bfloat16)
        """
        if not callable(loss_fn):
            raise MpmdError(
                f"Precision.wrap({loss_fn!r}): expected the loss function "
                "loss_fn(model, batch), e.g. policy.wrap(loss_fn)."
            )

        @functools.wraps(loss_fn)
        def loss_in_precision(model: Any, *args: Any, **kwargs: Any) -> Any:
            if cast_inputs:
                args, kwargs = self.cast_to_compute((args, kwargs))
            with self.computing(model, wrt):
                out = loss_fn(model, *args, **kwargs)
            return self.cast_to_output(out)

        return loss_in_precision


def _is_floating_dtype(value: Any) -> bool:
    """Whether ``value`` names a floating-point dtype (a module's ``dtype`` may hold anything)."""
    try:
        return jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
        return False


def _floating_variables(model: Any, wrt: Any) -> list[nnx.Variable]:
    """The Variables of ``model`` that ``wrt`` selects and that hold floating-point arrays."""
    out = []
    for _, variable in nnx.to_flat_state(nnx.state(model, wrt)):
        value = variable.get_value()
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating):
            out.append(variable)
    return out


def precision_from_names(dtype: str, param_dtype: str = "float32") -> Precision:
    """The policy of ``nnx-mpmd train --dtype DTYPE --param-dtype PARAM_DTYPE``.

    Args:
      dtype: the compute dtype's name, one of `DTYPE_NAMES`.
      param_dtype: the master parameters' dtype name, one of `DTYPE_NAMES`.

    Returns:
      The `Precision` (its output dtype is float32).

    Raises:
      MpmdError: a name that is not in `DTYPE_NAMES`.

    Example:
      >>> precision_from_names("bfloat16").compute_dtype
      dtype(bfloat16)
    """
    for flag, name in (("--dtype", dtype), ("--param-dtype", param_dtype)):
        if name not in DTYPE_NAMES:
            raise MpmdError(
                f"{flag} {name!r} is not a supported dtype; choose one of "
                f"{', '.join(DTYPE_NAMES)} (e.g. {flag} bfloat16)."
            )
    return Precision(compute_dtype=dtype, param_dtype=param_dtype)
