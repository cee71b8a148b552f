"""A text that says what a traced step computes, equal across processes, or None.

`nnx_mpmd.aot.step_store` keeps a step's compiled programs under the text
of everything they are made from, so that a later process that traces the same
step can run them without tracing, lowering or loading each program again.
That is only sound if two steps with equal texts compile to the same programs.
So this text is strict: every equation's primitive, parameters, context,
effects and the types of its values, wired by position; constants by their
bytes; a nested jaxpr in full. Where something cannot be written down
completely, the answer is None and nothing is stored:

* a function in a parameter is written as its module and name only when it
  comes from a library whose version is part of the store's key (JAX, Flax,
  optax, NumPy, nnx_mpmd), with the values it closes over; a function of the
  user's (a remat policy, say) gives None, since its code is not in the text;
* a ``custom_jvp`` rule is written as the jaxpr it traces to (the rule JAX's
  differentiation will use), so a changed rule changes the text;
* ``custom_vjp`` and host callbacks give None (their Python code runs at
  differentiation or run time), and so does a primitive that code outside
  those libraries differentiates or lowers (a primitive of the user's);
* an object whose ``repr`` shows a memory address gives None.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def text(fn):
  ...     return jaxpr_fingerprint(jax.make_jaxpr(fn)(jnp.ones(3)).jaxpr)
  >>> text(lambda x: x * 2.0) == text(lambda y: y * 2.0)
  True
  >>> text(lambda x: x * 2.0) == text(lambda x: x * -2.0)
  False
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import struct
import types
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_mpmd._jax_compat import jaxpr_value_types, primitive_rules

__all__ = ["LIBRARY_MODULES", "jaxpr_fingerprint", "value_fingerprint"]

#: Top-level modules whose functions are written by name: their versions (or, for
#: nnx_mpmd, the bytes of its sources) are part of the store's key.
LIBRARY_MODULES = frozenset(
    {"jax", "jaxlib", "flax", "optax", "numpy", "nnx_mpmd", "builtins", "operator", "math"}
)

# Primitives whose meaning is Python code that the jaxpr does not hold.
_REFUSED_PRIMITIVES = ("callback", "custom_vjp_call", "custom_lin")

_MAX_DEPTH = 64

_AbstractValue, _EquationContext = jaxpr_value_types()


class _Refused(Exception):
    """Something in the jaxpr cannot be written down completely."""


def jaxpr_fingerprint(jaxpr: Any) -> str | None:
    """The text of what ``jaxpr`` computes, or None (see the module docstring).

    Equal for two jaxprs written the same way (variables by position, no names or locations).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> j = jax.make_jaxpr(lambda x: jnp.sin(x) + 1)(jnp.ones(2))
      >>> jaxpr_fingerprint(j).count("sin")
      1
    """
    return value_fingerprint(jaxpr)


def value_fingerprint(value: Any) -> str | None:
    """The text of any value a step's compilation reads, or None where it cannot be complete.

    Example:
      >>> value_fingerprint((1, 2.5, "a")) == value_fingerprint((1, 2.5, "a"))
      True
      >>> def policy(*args):
      ...     return True
      >>> policy.__module__ = "my_model"  # as if the user's module defined it
      >>> value_fingerprint(policy) is None  # its code is not in the text
      True
    """
    writer = _Writer()
    try:
        writer.value(value, 0)
    except (_Refused, RecursionError):
        return None
    return "".join(writer.out)


class _Writer:
    def __init__(self) -> None:
        self.out: list[str] = []
        self._memo: dict[int, str] = {}  # interned objects (contexts, meshes): written once
        self._alive: list[Any] = []  # keeps memoized objects alive, so ids stay theirs
        self._avals: dict[Any, str] = {}
        self._in_rule = False  # writing a custom_jvp rule's jaxpr
        self._checked: set[int] = set()  # primitives whose rules are library code

    def write(self, *parts: str) -> None:
        self.out.extend(parts)

    def value(self, v: Any, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise _Refused("too deep")
        if v is None or isinstance(v, bool | int | str | bytes):
            self.write(type(v).__name__, ":", repr(v), ";")
        elif isinstance(v, float):
            self.write("float:", struct.pack("<d", v).hex(), ";")
        elif isinstance(v, complex):
            self.write("complex:", struct.pack("<dd", v.real, v.imag).hex(), ";")
        elif isinstance(v, jcore.ClosedJaxpr):
            self.write("closed{")
            for c in v.consts:
                self.value(c, depth + 1)
            self.jaxpr(v.jaxpr, depth + 1)
            self.write("}")
        elif isinstance(v, jcore.Jaxpr):
            self.jaxpr(v, depth + 1)
        elif isinstance(v, np.ndarray | np.generic):
            self.array(np.asarray(v))
        elif isinstance(v, jax.Array):
            if not v.is_fully_addressable:
                raise _Refused("an array with shards on other processes")
            self.array(np.asarray(v))
        elif isinstance(v, np.dtype) or _is_dtype(v):
            self.write("dtype:", str(v), ";")
        elif isinstance(v, enum.Enum):
            self.write("enum:", _qualified(type(v)), ".", v.name, ";")
        elif isinstance(v, _AbstractValue):
            self.aval(v)
        elif isinstance(v, Mesh):
            self.memoized(v, lambda: _mesh_text(v))
        elif isinstance(v, NamedSharding):
            self.write("named(")
            self.value(v.mesh, depth + 1)
            self.write(repr(v.spec), ",", repr(v.memory_kind), ")")
        elif isinstance(v, PartitionSpec):
            self.write(repr(v), ";")
        elif isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple
            self.sequence(_qualified(type(v)), v, depth)
        elif isinstance(v, tuple | list):
            self.sequence(type(v).__name__, v, depth)
        elif isinstance(v, dict):
            self.write("dict{")
            for key in sorted(v, key=repr):
                self.value(key, depth + 1)
                self.value(v[key], depth + 1)
            self.write("}")
        elif isinstance(v, frozenset | set):
            parts = sorted(value_fingerprint(x) or _refuse() for x in v)
            self.write("set{", "".join(parts), "}")
        elif isinstance(v, _EquationContext):
            self.memoized(v, lambda: _slots_text(v))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            self.write("data:", _qualified(type(v)), "{")
            for field in dataclasses.fields(v):
                self.write(field.name, "=")
                self.value(getattr(v, field.name), depth + 1)
            self.write("}")
        elif isinstance(v, functools.partial):
            self.write("partial(")
            self.value(v.func, depth + 1)
            self.value(v.args, depth + 1)
            self.value(v.keywords, depth + 1)
            self.write(")")
        elif isinstance(v, types.FunctionType):
            self.function(v, depth)
        elif isinstance(v, type | types.BuiltinFunctionType | np.ufunc):
            self.library_name(v)
        else:
            self.library_object(v)

    def sequence(self, kind: str, items: Any, depth: int) -> None:
        self.write(kind, "[")
        for item in items:
            self.value(item, depth + 1)
        self.write("]")

    def array(self, a: np.ndarray) -> None:
        digest = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
        self.write("array:", a.dtype.str, str(a.shape), digest, ";")

    def aval(self, a: Any) -> None:
        try:
            found = self._avals.get(a)
        except TypeError:  # unhashable: written each time
            found = None
        if found is None:
            found = _aval_text(a)
            with contextlib.suppress(TypeError):
                self._avals[a] = found
        self.write(found)

    def memoized(self, v: Any, text: Any) -> None:
        found = self._memo.get(id(v))
        if found is None:
            found = self._memo[id(v)] = text()
            self._alive.append(v)
        self.write(found)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        self.library_name(fn)
        self.write("(")
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell: a name not yet bound
                contents = "<empty cell>"
            self.value(contents, depth + 1)
        self.value(fn.__defaults__, depth + 1)
        self.value(fn.__kwdefaults__, depth + 1)
        self.write(")")

    def library_name(self, obj: Any) -> None:
        module = getattr(obj, "__module__", None) or ""
        if module.partition(".")[0] not in LIBRARY_MODULES:
            raise _Refused(f"{obj!r} is not library code")
        self.write("fn:", module, ".", getattr(obj, "__qualname__", repr(obj)), ";")

    def library_object(self, v: Any) -> None:
        module = type(v).__module__ or ""
        if module.partition(".")[0] not in LIBRARY_MODULES:
            raise _Refused(f"a {type(v).__name__} from {module}")
        text = repr(v)
        if text.startswith("<"):  # object.__repr__ or similar: says nothing of the value
            raise _Refused(f"no complete repr for {type(v).__name__}")
        self.write("obj:", _qualified(type(v)), ":", _no_address(text), ";")

    def jaxpr(self, j: Any, depth: int) -> None:
        names: dict[Any, int] = {}

        def atom(v: Any) -> None:
            if isinstance(v, jcore.Literal):
                self.write("lit(")
                self.value(v.val, depth + 1)
                self.aval(v.aval)
                self.write(")")
            elif type(v).__name__ == "DropVar":
                self.write("_")
            else:
                self.write("v", str(names[v]), ",")

        def bind(v: Any) -> None:
            if type(v).__name__ != "DropVar":
                names[v] = len(names)
            self.aval(v.aval)

        self.write("jaxpr{")
        for v in [*j.constvars, *j.invars]:
            bind(v)
        self.write("|")
        for eqn in j.eqns:
            self.equation(eqn, atom, bind, depth)
        self.write("->")
        for v in j.outvars:
            atom(v)
        self.write("effects:", _no_address(repr(sorted(map(repr, j.effects)))), "}")

    def equation(self, eqn: Any, atom: Any, bind: Any, depth: int) -> None:
        name = eqn.primitive.name
        if any(word in name for word in _REFUSED_PRIMITIVES):
            raise _Refused(f"{name}: Python code outside the jaxpr")
        self.check_rules(eqn.primitive)
        self.write("eqn:", name, "(")
        for v in eqn.invars:
            atom(v)
        self.write("){")
        for key in sorted(eqn.params):
            self.write(key, "=")
            param = eqn.params[key]
            if name == "custom_jvp_call" and key == "jvp_jaxpr_fun":
                # Inside a rule, a call is only evaluated, never differentiated:
                # its own rule does not matter (and may be this rule again).
                if self._in_rule:
                    self.write("rule of a rule;")
                else:
                    self.custom_jvp_rule(param, eqn, depth)
            else:
                self.value(param, depth + 1)
        self.write("}ctx:")
        self.value(eqn.ctx, depth + 1)
        self.write("eff:", _no_address(repr(sorted(map(repr, eqn.effects)))), "out:")
        for v in eqn.outvars:
            bind(v)
        self.write(";")

    def check_rules(self, primitive: Any) -> None:
        """Refuses a primitive that code outside the libraries differentiates or lowers.

        A primitive of the user's, with its rules in the user's code, is only
        its name in the text: a changed rule would not change it.
        """
        if id(primitive) in self._checked:
            return
        for rule in primitive_rules(primitive):
            for module in _modules_of(rule, 0):
                if module.partition(".")[0] not in LIBRARY_MODULES:
                    raise _Refused(f"{primitive} has a rule in {module}")
        self._checked.add(id(primitive))
        self._alive.append(primitive)

    def custom_jvp_rule(self, rule: Any, eqn: Any, depth: int) -> None:
        """The jaxpr of the rule for all tangents nonzero (the call JAX memoizes)."""
        if eqn.params.get("symbolic_zeros"):
            raise _Refused("a custom_jvp rule that sees symbolic zeros")
        num_primals = len(eqn.invars) - eqn.params.get("num_consts", 0)
        try:
            jvp_jaxpr, consts, out_zeros = rule.call_wrapped(*([False] * num_primals))
        except Exception as e:
            raise _Refused("the custom_jvp rule did not trace") from e
        self.write("jvp{")
        self._in_rule = True
        try:
            self.value(list(consts), depth + 1)
            self.value(jvp_jaxpr, depth + 1)
        finally:
            self._in_rule = False
        self.value(list(out_zeros), depth + 1)
        self.write("}")


def _modules_of(rule: Any, depth: int) -> list[str]:
    """The modules defining ``rule``'s functions, through partials and tuples of them.

    Nesting deeper than it looks gives a module no library has, so that the
    rule is refused rather than trusted unread.
    """
    if depth > 8:
        return ["<nested too deep to read>"]
    if isinstance(rule, functools.partial):
        parts = [rule.func, *rule.args, *rule.keywords.values()]
        return [m for part in parts for m in _modules_of(part, depth + 1)]
    if isinstance(rule, tuple | list):
        return [m for part in rule for m in _modules_of(part, depth + 1)]
    module = getattr(rule, "__module__", None) if callable(rule) else None
    modules = [module] if isinstance(module, str) else []
    for cell in getattr(rule, "__closure__", None) or ():  # a library wrapper of the user's
        try:
            contents = cell.cell_contents
        except ValueError:
            continue
        if callable(contents) or isinstance(contents, tuple | list):
            modules += _modules_of(contents, depth + 1)
    return modules


def _refuse() -> str:
    raise _Refused("an element of a set")


def _is_dtype(v: Any) -> bool:
    return type(v).__module__.startswith("jax") and type(v).__name__.endswith("DType")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _no_address(text: str) -> str:
    if " at 0x" in text or "object at" in text:
        raise _Refused(f"a repr with an address: {text[:80]}")
    return text


def _aval_text(a: Any) -> str:
    parts = [
        type(a).__name__,
        str(getattr(a, "shape", "")),
        str(getattr(a, "dtype", "")),
        str(getattr(a, "weak_type", "")),
        _no_address(repr(getattr(a, "sharding", None))),
        _no_address(repr(getattr(a, "vma", None))),
        _no_address(repr(getattr(a, "memory_space", None))),
    ]
    if type(a).__name__ != "ShapedArray":
        parts.append(_no_address(str(a)))
    return "aval(" + ",".join(parts) + ")"


def _mesh_text(mesh: Mesh) -> str:
    devices = list(mesh.devices.flat)
    ids = ",".join(str(getattr(d, "id", d)) for d in devices)
    platform = getattr(devices[0], "platform", "") if devices else ""
    return (
        f"mesh({tuple(mesh.axis_names)},{mesh.devices.shape},"
        f"{tuple(str(t) for t in mesh.axis_types)},{platform}:{ids});"
    )


def _slots_text(obj: Any) -> str:
    return (
        value_fingerprint(
            {
                slot: getattr(obj, slot, None)
                for slot in type(obj).__slots__
                if slot != "__weakref__"
            }
        )
        or _refuse()
    )
