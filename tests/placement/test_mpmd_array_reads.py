"""Reading an `MpmdArray` like the ``jax.Array`` it stands for.

Every operation is compared with the same operation on the equivalent
``jax.Array``: same type of result, same dtype, same value (or the same kind of
error). Copies that disagree, and copies this process cannot read, raise a
`PlacementError` instead of giving a number. The last tests run a real 2-stage
``mp.jit`` step and read ``opt.step`` and the loss as in plain NNX.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import MLP, make_batch, make_mesh, mlp_loss, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.errors import MpmdError, PlacementError
from nnx_mpmd.placement import mpmd_array
from nnx_mpmd.placement.mpmd_array import MpmdArray

MESH = make_mesh(4, 2)
COPY_MESHES = (0, 2)

VALUES = {
    "f32 scalar": np.float32(0.75),
    "i32 scalar": np.int32(7),
    "u32 step": np.uint32(3),
    "bool scalar": np.bool_(True),
    "f32 vector": np.arange(4, dtype=np.float32) - 1.5,
    "i32 matrix": np.arange(8, dtype=np.int32).reshape(2, 4),
}
SCALARS = ["f32 scalar", "i32 scalar", "u32 step", "bool scalar"]
NUMERIC = ["f32 scalar", "i32 scalar", "u32 step", "f32 vector", "i32 matrix"]


def replicated(value, mesh_ids=COPY_MESHES, spec=None):
    """(the MpmdArray with a copy of ``value`` on each mesh, the equivalent jax.Array)."""
    reference = jnp.asarray(value)
    spec = P() if spec is None else spec
    copies = {q: jax.device_put(reference, NamedSharding(MESH.submesh(q), spec)) for q in mesh_ids}
    return MpmdArray(copies, mesh=MESH), reference


def outcome(fn, x):
    """What ``fn(x)`` gives: ("ok", type, dtype, value) or ("error", exception type)."""
    try:
        result = fn(x)
    except Exception as error:  # the kind of error is what is compared
        return ("error", type(error))
    if isinstance(result, jax.Array | np.ndarray | np.generic):
        values = repr(np.asarray(result).tolist())  # as text, so nan equals nan
        return ("ok", isinstance(result, jax.Array), str(result.dtype), values)
    if isinstance(result, tuple):
        return ("ok", tuple, [outcome(lambda r: r, r) for r in result])
    return ("ok", type(result), result)


def assert_same_as_jax(fn, name):
    x, reference = replicated(VALUES[name])
    expected = outcome(fn, reference)
    got = outcome(fn, x)
    assert got == expected, f"{name}: got {got}, jax.Array gives {expected}"


# ------------------------------------------------------------- host reads

READS = {
    "int": int,
    "float": float,
    "bool": bool,
    "complex": complex,
    "index": operator.index,
    "item": lambda a: a.item(),
    "tolist": lambda a: a.tolist(),
    "np.asarray": np.asarray,
    "np.asarray f64": lambda a: np.asarray(a, dtype=np.float64),
    "np.array copy": lambda a: np.array(a, copy=True),
    "__array__ dtype copy": lambda a: a.__array__(np.float32, copy=True),
    "str": str,
    "format .3f": lambda a: f"{a:.3f}",
    "format empty": lambda a: f"{a}",
    "format >8": lambda a: format(a, ">8"),
    "shape": lambda a: a.shape,
    "dtype": lambda a: str(a.dtype),
    "ndim": lambda a: a.ndim,
    "size": lambda a: a.size,
    "len": len,
    "list": lambda a: [np.asarray(v).tolist() for v in a],
    "round": lambda a: round(float(a), 2),
}


@pytest.mark.parametrize("name", list(VALUES))
@pytest.mark.parametrize("read", list(READS))
def test_host_read_equals_jax_array(read, name):
    assert_same_as_jax(READS[read], name)


def test_copy_false_without_conversion_like_jax():
    x, reference = replicated(VALUES["f32 vector"])
    np.testing.assert_array_equal(x.__array__(copy=False), reference.__array__(copy=False))


# ------------------------------------------------------------- indexing

INDEXES = {
    "...": ...,
    "()": (),
    "0": 0,
    "-1": -1,
    "slice": slice(1, 3),
    "step slice": slice(None, None, 2),
    "row, col": (1, 2),
    "None": None,
    "bool mask": np.array([True, False, True, False]),
    "out of range": 9,
}


@pytest.mark.parametrize("name", list(VALUES))
@pytest.mark.parametrize("index", list(INDEXES))
def test_indexing_equals_jax_array(index, name):
    assert_same_as_jax(lambda a: a[INDEXES[index]], name)


def test_indexing_returns_a_jax_array_on_the_lowest_copy():
    x, _ = replicated(VALUES["f32 vector"])
    result = x[1:]
    assert isinstance(result, jax.Array)
    assert result.sharding.device_set == x.array(0).sharding.device_set


# ------------------------------------------------------------- arithmetic, comparison

BINARY = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    ">=": operator.ge,
    "divmod": divmod,
}
OTHERS = {
    "int": lambda: 2,
    "float": lambda: 1.5,
    "np.float32": lambda: np.float32(2.5),
    "np.int32 array": lambda: np.array([1, 2, 3, 4], dtype=np.int32),
    "jax float": lambda: jnp.float32(3.0),
    "jax array": lambda: jnp.array([1.0, -2.0, 3.0, 0.5]),
}


@pytest.mark.parametrize("other", list(OTHERS))
@pytest.mark.parametrize("op", list(BINARY))
@pytest.mark.parametrize("name", ["f32 scalar", "i32 scalar", "f32 vector"])
def test_binary_operators_both_sides_equal_jax_array(name, op, other):
    fn, make_other = BINARY[op], OTHERS[other]
    assert_same_as_jax(lambda a: fn(a, make_other()), name)
    assert_same_as_jax(lambda a: fn(make_other(), a), name)


@pytest.mark.parametrize(
    "fn",
    [
        operator.neg,
        operator.pos,
        abs,
        lambda a: a @ np.ones(4, np.float32),
        lambda a: np.ones(4, np.float32) @ a,
        lambda a: a @ a,
        lambda a: a + a,
        lambda a: a < a,
    ],
    ids=["neg", "pos", "abs", "matmul", "rmatmul", "self matmul", "self add", "self lt"],
)
@pytest.mark.parametrize("name", ["f32 vector", "i32 matrix", "f32 scalar"])
def test_unary_matmul_and_self_operators_equal_jax_array(name, fn):
    assert_same_as_jax(fn, name)


@pytest.mark.parametrize("fn", [operator.invert, operator.and_, operator.or_, operator.xor])
def test_bitwise_operators_equal_jax_array(fn):
    if fn is operator.invert:
        assert_same_as_jax(fn, "i32 matrix")
    else:
        assert_same_as_jax(lambda a: fn(a, 6), "i32 matrix")
        assert_same_as_jax(lambda a: fn(6, a), "i32 matrix")


def test_operands_on_the_copy_next_to_a_committed_jax_array():
    x, reference = replicated(VALUES["f32 vector"])
    on_mesh_2 = jax.device_put(jnp.ones(4), NamedSharding(MESH.submesh(2), P()))
    result = x + on_mesh_2
    assert result.sharding.device_set == on_mesh_2.sharding.device_set
    np.testing.assert_array_equal(result, reference + 1)
    result = on_mesh_2 * x
    assert result.sharding.device_set == on_mesh_2.sharding.device_set


def test_two_mpmd_arrays_use_a_common_mesh_or_the_host():
    x, reference = replicated(VALUES["f32 vector"], mesh_ids=(1, 2))
    y, _ = replicated(VALUES["f32 vector"], mesh_ids=(2, 3))
    result = x + y
    assert result.sharding.device_set == x.array(2).sharding.device_set
    np.testing.assert_array_equal(result, 2 * reference)
    z, _ = replicated(VALUES["f32 vector"], mesh_ids=(0,))
    np.testing.assert_array_equal(x * z, reference * reference)


def test_sharded_copies_read_like_the_whole_array():
    value = np.arange(8, dtype=np.float32)
    x, reference = replicated(value, spec=P("data"))
    np.testing.assert_array_equal(np.asarray(x), value)
    assert str(x) == str(reference)
    np.testing.assert_array_equal(x * 2, reference * 2)
    assert x[3].item() == 3.0


def test_stays_hashable_by_identity():
    x, _ = replicated(VALUES["f32 scalar"])
    assert {x: 1}[x] == 1
    assert hash(x) == object.__hash__(x)


def test_repr_keeps_the_placement_form():
    x, _ = replicated(VALUES["u32 step"])
    assert repr(x) == "MpmdArray(shape=(), dtype=uint32, meshes=(0, 2), spec=P())"


# ------------------------------------------------------------- errors

HOST_READS = {
    "int": int,
    "float": float,
    "bool": bool,
    "np.asarray": np.asarray,
    "item": lambda a: a.item(),
    "tolist": lambda a: a.tolist(),
    "format": lambda a: f"{a:.3f}",
    "str": str,
}


@pytest.mark.parametrize("read", list(HOST_READS))
def test_copies_that_disagree_raise_instead_of_giving_a_number(read):
    copies = {
        0: jax.device_put(jnp.float32(1.0), NamedSharding(MESH.submesh(0), P())),
        3: jax.device_put(jnp.float32(2.0), NamedSharding(MESH.submesh(3), P())),
    }
    x = MpmdArray(copies, mesh=MESH)
    with pytest.raises(
        PlacementError,
        match=r"copies disagree \(mesh 0 holds 1\.0, mesh 3 holds 2\.0\).*x\.array\(mesh_id\)",
    ):
        HOST_READS[read](x)
    assert float(x.array(3)) == 2.0  # one copy can still be read explicitly


def test_copies_equal_up_to_rounding_read_as_the_lowest_copy():
    copies = {
        0: jax.device_put(jnp.float32(1.0), MESH.devices(0)[0]),
        1: jax.device_put(jnp.nextafter(jnp.float32(1.0), 2.0), MESH.devices(1)[0]),
    }
    assert float(MpmdArray(copies)) == 1.0


@pytest.mark.parametrize(
    "fn",
    [*HOST_READS.values(), lambda a: a[0], lambda a: a + 1, lambda a: a > 1, len],
    ids=[*HOST_READS, "getitem", "add", "compare", "len"],
)
def test_no_readable_copy_raises(monkeypatch, fn):
    x, _ = replicated(VALUES["f32 vector"])
    monkeypatch.setattr(mpmd_array, "_is_readable", lambda array: False)
    if fn is str:
        assert str(x) == repr(x)  # like a jax.Array held by other processes
        return
    with pytest.raises(
        MpmdError, match=r"holds no complete copy .*meshes \(0, 2\).*mp\.gather\(\.\.\.\)"
    ):
        fn(x)


ASSIGNMENTS = {
    "whole-vector": ("f32 vector", None, ..., 2.5),
    "one-element": ("f32 vector", None, 1, np.float32(9.0)),
    "row-slice-from-a-device-array": ("i32 matrix", None, (0, slice(1, 3)), jnp.array([5, 6])),
    "step-count": ("u32 step", None, ..., 10),
    "data-sharded": ("f32 vector", P("data"), ..., np.ones(4, np.float32)),
}


@pytest.mark.parametrize("case", ASSIGNMENTS, ids=list(ASSIGNMENTS))
def test_item_assignment_updates_every_copy_like_at_set(case):
    name, spec, index, value = ASSIGNMENTS[case]
    x, reference = replicated(VALUES[name], spec=spec)
    shardings = {q: x.array(q).sharding for q in x.mesh_ids}
    x[index] = value  # what `variable[...] = value` does to a placed Variable
    want = np.asarray(reference.at[index].set(value))
    for q in x.mesh_ids:
        copy = x.array(q)
        assert copy.sharding == shardings[q] and copy.dtype == reference.dtype
        np.testing.assert_array_equal(np.asarray(copy), want)


def test_item_assignment_into_copies_on_other_processes_is_refused(monkeypatch):
    x, _ = replicated(VALUES["f32 vector"])
    monkeypatch.setattr(mpmd_array, "_is_readable", lambda array: False)
    with pytest.raises(
        PlacementError, match=r"cannot write into .*meshes \[0, 2\] live on other.*set_value"
    ):
        x[...] = 1.0


# ------------------------------------------------------------- after a real mp.jit step


def run_two_steps():
    """(mp.jit model, optimizer, losses), (nnx.jit model, optimizer, losses)."""
    results = []
    for pipelined in (True, False):
        model = MLP(2, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        if pipelined:
            step = mp.jit(
                train_step_fn(mlp_loss),
                mesh=make_mesh(2, 1),
                schedule=mp.OneFOneB(),
                num_microbatches=4,
            )
        else:
            step = nnx.jit(train_step_fn(mlp_loss, 4))
        losses = [step(model, opt, make_batch("regression", 8, seed=s)) for s in range(2)]
        results.append((model, opt, losses))
    return results


@pytest.fixture(scope="module")
def trained():
    return run_two_steps()


def test_optimizer_step_reads_as_in_plain_nnx(trained):
    (_, opt, _), (_, ref_opt, _) = trained
    assert isinstance(opt.step.get_value(), MpmdArray)  # one copy per mesh
    assert int(opt.step[...]) == int(ref_opt.step[...]) == 2
    assert isinstance(opt.step[...], jax.Array)
    assert int(opt.step.get_value()) == int(ref_opt.step.get_value())
    assert opt.step.get_value() == ref_opt.step.get_value()
    assert int(opt.step) == 2 and opt.step.get_value().item() == 2
    assert (opt.step + 1).dtype == (ref_opt.step + 1).dtype
    assert int(opt.step + 1) == int(ref_opt.step + 1) == 3
    assert f"{opt.step.get_value()}" == f"{ref_opt.step.get_value()}" == "2"
    assert str(opt.step.get_value()) == str(ref_opt.step.get_value())


def test_loss_reads_as_in_plain_nnx(trained):
    (_, _, losses), (_, _, ref_losses) = trained
    for loss, ref_loss in zip(losses, ref_losses):
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        assert f"{loss:.4f}" == f"{ref_loss:.4f}"
        np.testing.assert_allclose(loss + 1, ref_loss + 1, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5)


def test_a_loss_returned_on_every_mesh_reads_as_in_plain_nnx():
    """A value that lives on both meshes comes back as an MpmdArray and reads the same."""

    def step_fn(model, optimizer, batch):
        loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
        optimizer.update(model, grads)
        return loss, optimizer.step[...]

    def ref_step_fn(model, optimizer, batch):
        loss, grads = mp.value_and_grad(mlp_loss, num_microbatches=4)(model, batch)
        optimizer.update(model, grads)
        return loss, optimizer.step[...]

    model = MLP(2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    ref_model = MLP(2, rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.adamw(1e-3), wrt=nnx.Param)
    step = mp.jit(step_fn, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=4)
    batch = make_batch("regression", 8)
    loss, count = step(model, opt, batch)
    ref_loss, ref_count = nnx.jit(ref_step_fn)(ref_model, ref_opt, batch)
    assert int(count) == int(ref_count) == 1
    assert count + 1 == ref_count + 1
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert f"{loss:.4f}" == f"{ref_loss:.4f}"


def test_hyperparameters_assigned_between_steps_train_like_nnx_jit():
    """``opt_state.hyperparams["learning_rate"][...] = lr`` on placed state, as in plain NNX."""
    models = [MLP(2, rngs=nnx.Rngs(0)) for _ in range(2)]
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    opts = [nnx.Optimizer(m, tx, wrt=nnx.Param) for m in models]
    steps = [
        mp.jit(
            train_step_fn(mlp_loss),
            mesh=make_mesh(2, 2),
            schedule=mp.OneFOneB(),
            num_microbatches=4,
        ),
        nnx.jit(train_step_fn(mlp_loss, 4)),
    ]
    for i in range(3):
        batch = make_batch("regression", 8, seed=i)
        losses = [float(step(m, o, batch)) for step, m, o in zip(steps, models, opts, strict=True)]
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
        for opt in opts:
            opt.opt_state.hyperparams["learning_rate"][...] = 0.1 * (i + 1)
            opt.step[...] += 1
    assert isinstance(opts[0].opt_state.hyperparams["learning_rate"].get_value(), MpmdArray)
    assert int(opts[0].step[...]) == int(opts[1].step[...]) == 6
    for a, b in zip(
        jax.tree.leaves(nnx.state(models[0], nnx.Param)),
        jax.tree.leaves(nnx.state(models[1], nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
