"""The text of a traced step: equal exactly when the programs made of it are."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_mpmd.aot.fingerprint import jaxpr_fingerprint, value_fingerprint


def _text(fn, *args):
    return jaxpr_fingerprint(jax.make_jaxpr(fn)(*args))


X = jnp.ones((4, 3), jnp.float32)


def test_names_and_source_lines_do_not_matter():
    def first(a):
        return jnp.sin(a) * 2.0

    def second(b):
        return jnp.sin(b) * 2.0

    assert _text(first, X) is not None
    assert _text(first, X) == _text(second, X)


@pytest.mark.parametrize(
    "other",
    [
        lambda a: jnp.sin(a) * -2.0,  # a literal's value
        lambda a: jnp.cos(a) * 2.0,  # a primitive
        lambda a: jnp.sin(a) * 2.0 + 0.0,  # an equation more
        lambda a: jnp.sin(a).T @ a * 2.0,  # wiring and shapes
    ],
    ids=["literal", "primitive", "equation", "wiring"],
)
def test_any_change_of_the_computation_changes_the_text(other):
    assert _text(lambda a: jnp.sin(a) * 2.0, X) != _text(other, X)


def test_zero_and_negative_zero_differ():
    assert _text(lambda a: a * 0.0, X) != _text(lambda a: a * -0.0, X)


def test_input_types_and_shardings_are_in_the_text():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    other = jax.make_mesh((2,), ("data",), devices=jax.devices()[2:4])

    def fn(a):
        return a * 2

    texts = {
        "f32": _text(fn, X),
        "f16": _text(fn, X.astype(jnp.float16)),
        "shape": _text(fn, jnp.ones((3, 4))),
    }
    assert len(set(texts.values())) == 3
    placed = [jax.device_put(X, NamedSharding(m, P())) for m in (mesh, other)]
    assert value_fingerprint(placed[0].sharding) != value_fingerprint(placed[1].sharding)


def test_constants_are_written_by_value():
    a, b = np.arange(12.0).reshape(4, 3), np.arange(12.0).reshape(4, 3)
    b[0, 0] = -1.0
    assert _text(lambda x: x + a, X) != _text(lambda x: x + b, X)
    assert _text(lambda x: x + a, X) == _text(lambda x: x + a.copy(), X)


def _with_rule(scale):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return jnp.sin(x), scale * jnp.cos(x) * t

    return f


def test_a_custom_jvp_rule_is_written_as_the_jaxpr_it_traces_to():
    # Same primal, another derivative: the backward programs differ, so must the text.
    assert _text(_with_rule(1.0), X) is not None
    assert _text(_with_rule(1.0), X) == _text(_with_rule(1.0), X)
    assert _text(_with_rule(1.0), X) != _text(_with_rule(2.0), X)
    assert _text(jax.nn.relu, X) is not None  # a library rule


def test_custom_vjp_and_host_callbacks_have_no_text():
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (g,))
    assert _text(f, X) is None

    def callback(a):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(a.shape, a.dtype), a)

    assert _text(callback, X) is None


def _user_policy(*args, **kwargs):
    return False


def test_a_remat_policy_of_the_users_has_no_text_and_a_librarys_has():
    def remat(policy):
        return _text(jax.checkpoint(lambda a: jnp.sin(jnp.sin(a)), policy=policy), X)

    assert remat(jax.checkpoint_policies.dots_saveable) is not None
    assert remat(jax.checkpoint_policies.save_only_these_names("a")) != remat(
        jax.checkpoint_policies.save_only_these_names("b")
    )
    assert remat(_user_policy) is None  # defined in this test module: not in the key
    assert remat(functools.partial(_user_policy, 1)) is None


def test_values_without_a_complete_text_give_none():
    class Opaque:
        pass

    assert value_fingerprint(Opaque()) is None
    assert value_fingerprint({"a": (1, 2.0, "x")}) == value_fingerprint({"a": (1, 2.0, "x")})
    assert value_fingerprint(1) != value_fingerprint(1.0) != value_fingerprint(True)


def test_the_text_is_the_same_in_another_process():
    code = textwrap.dedent(
        """
        import hashlib, jax, jax.numpy as jnp
        from nnx_mpmd.aot.fingerprint import jaxpr_fingerprint
        def fn(a, w):
            return jax.nn.relu(a @ w).sum() * 0.5
        j = jax.make_jaxpr(jax.grad(fn))(jnp.ones((4, 3)), jnp.ones((3, 2)))
        print(hashlib.sha256(jaxpr_fingerprint(j).encode()).hexdigest())
        """
    )
    import hashlib

    def fn(a, w):
        return jax.nn.relu(a @ w).sum() * 0.5

    here = jaxpr_fingerprint(jax.make_jaxpr(jax.grad(fn))(jnp.ones((4, 3)), jnp.ones((3, 2))))
    result = subprocess.run(
        ["timeout", "-k", "5", "120", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert result.stdout.strip() == hashlib.sha256(here.encode()).hexdigest()


def test_a_primitive_with_rules_of_the_users_has_no_text():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    double = Primitive("double_of_the_user")
    double.def_abstract_eval(lambda x: x)
    mlir.register_lowering(double, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    assert _text(lambda a: double.bind(a) + 1.0, X) is None
    assert _text(lambda a: jax.lax.sin(a) + 1.0, X) is not None


def test_a_rule_nested_too_deep_to_read_is_not_trusted():
    from nnx_mpmd.aot.fingerprint import LIBRARY_MODULES, _modules_of

    rule = jnp.sin  # library code, nested deeper than is read
    for _ in range(12):
        rule = functools.partial(jax.jit, (rule,))
    assert any(m.partition(".")[0] not in LIBRARY_MODULES for m in _modules_of(rule, 0))
    assert all(
        m.partition(".")[0] in LIBRARY_MODULES for m in _modules_of(functools.partial(jnp.sin), 0)
    )
