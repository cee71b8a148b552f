"""Mesh inference, two late passes: what each mesh's outer programs compute.

`drop_unread_equations`: mesh inference runs an equation on every mesh that
needs its results' *consumers*, and an equation without inputs (a broadcast
zero) costs nothing to run anywhere, so some land on meshes where nothing reads
them. They are removed, mesh by mesh.

`split_common_parts`: a mesh's program after the region (the optimizer update)
holds one piece of work per parameter, independent of the others once a few
small values are known (the global norm, the step count: the *prologue*). When
the first mesh holds the embedding and one block, the middle meshes one block
each and the last a block and the final norm, the middle meshes' programs are
equal (loaded, not compiled, on equal-shaped submeshes), but the first and last
meshes' are not, although most of their work is the same block update: XLA
compiles it again in each module, kernel by kernel. Such a program is cut into
the rest (with the prologue) and a *common* part equal to the smallest program
of its level that the others contain; a program that is all common part runs
its prologue as a program of its own, unless the prologue is equal on every mesh
and the rest reads none of its values (the step count of an SGD-like update):
then it runs inside the common part everywhere. The common parts of every mesh are then
one program, compiled once, and the rest is small. The pieces are independent,
so running them as separate programs computes the same values. Programs equal
piece by piece but not as wholes (with a global-norm clip each mesh receives every
mesh's small gradients and updates its own, read at another argument on each mesh)
are split too, into a prologue and a common part that are each equal on every mesh
(`_wired_apart`). A program that sends a packed transfer, or that has effects, is
not split. Whether two parts are really equal is decided later, as for any
program, by `Call.structure`; this pass only arranges for them to be.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from nnx_mpmd.compiler.jaxpr_utils import is_literal, make_subprogram, structure_key, var_bytes
from nnx_mpmd.compiler.outer.outer_assign import ValueOnMesh
from nnx_mpmd.compiler.outer.outer_emit import OuterGroup, OuterLevels, Part
from nnx_mpmd.compiler.outer.outer_packing import PackedTransfer

__all__ = ["drop_unread_equations", "split_common_parts"]

# The prologue's values are at most this big (a global norm's partial sums, the
# small gradients some meshes send every mesh): bigger work is a piece of its own.
_PROLOGUE_BYTES = 16 * 1024

# A common part smaller than this many equations is not worth a program of its own.
_MIN_COMMON_EQUATIONS = 4


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """A program's equations: the prologue and the independent pieces after it.

    ``prologue`` lists the small equations that compute scalars, and the small
    equations they read, from the program's inputs (in program order);
    ``pieces`` the connected sets of the other equations, in order of their
    first equation; ``keys[k]`` says what piece ``k`` computes and which
    prologue values it reads.
    """

    prologue: tuple[int, ...]
    pieces: tuple[tuple[int, ...], ...]
    keys: tuple[Any, ...]


def drop_unread_equations(levels: OuterLevels, kept: set[ValueOnMesh]) -> OuterLevels:
    """Pass: removes each equation from the meshes where nothing reads its results.

    It stays where it has effects, or a result is kept, packed, or read by a staying equation.

    Example:
      >>> import dataclasses, jax, jax.numpy as jnp
      >>> from nnx_mpmd.compiler.outer.outer_assign import OuterProblem, assign_meshes
      >>> from nnx_mpmd.compiler.outer.outer_emit import kept_values, level_equations
      >>> closed = jax.make_jaxpr(lambda a, b: (a + jnp.zeros(2), b * 2))(jnp.ones(2), jnp.ones(2))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {1}], [{0}, {1}], ["a", "b"],
      ...                        jax.devices()[:2], lambda j, q: None)
      >>> levels = level_equations(assign_meshes(problem, {}, region_at=len(closed.eqns)))
      >>> on_1 = next(g for g in levels.groups if g.mesh == 1)  # the zeros on mesh 1 too
      >>> levels = dataclasses.replace(levels, groups={**levels.groups, on_1: (0, 2)})
      >>> print(levels)
      pre.L0.mesh0: 0:broadcast_in_dim 1:add
      pre.L0.mesh1: 0:broadcast_in_dim 2:mul
      >>> print(drop_unread_equations(levels, kept_values(problem, levels)))
      pre.L0.mesh0: 0:broadcast_in_dim 1:add
      pre.L0.mesh1: 2:mul
    """
    eqns = levels.assignment.jaxpr.eqns
    needed: dict[int, set[Any]] = {}  # mesh -> values read there
    for value in kept:
        needed.setdefault(value.mesh, set()).add(value.var)
    for t in levels.transfers:
        if isinstance(t, PackedTransfer):
            needed.setdefault(t.src, set()).update(t.vars)
    placed = sorted(
        ((i, g.mesh) for g, members in levels.groups.items() for i in members), reverse=True
    )  # an equation is in one program per mesh
    live: set[tuple[int, int]] = set()
    for i, q in placed:
        e, there = eqns[i], needed.setdefault(q, set())
        if e.effects or any(o in there for o in e.outvars):
            live.add((i, q))
            there.update(v for v in e.invars if not is_literal(v))
    if len(live) == len(placed):
        return levels
    groups = {}
    for group, members in levels.groups.items():
        kept_members = tuple(i for i in members if (i, group.mesh) in live)
        if kept_members:
            groups[group] = kept_members
    return dataclasses.replace(levels, groups=groups)


def split_common_parts(levels: OuterLevels) -> OuterLevels:
    """Pass: splits programs that contain an equal-shaped mesh's program into it and the rest.

    Per segment and level the smallest contained program is the common part (`Part.COMMON`,
    ``post_common.L1.mesh0``), compiled once; the rest is `Part.WHOLE` or `Part.PROLOGUE`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nnx_mpmd.compiler.outer.outer_assign import OuterProblem, assign_meshes
      >>> from nnx_mpmd.compiler.outer.outer_emit import level_equations
      >>> def update(a, b, c, s):  # a's and c's updates are equal; b's is one more
      ...     step = lambda x: x * 0.9 - jnp.sqrt(x * x + 1.0) * s
      ...     return step(a), step(b) * 2.0, step(c), s + 1.0
      >>> x = jnp.ones(4)
      >>> closed = jax.make_jaxpr(update)(x, x, x, jnp.float32(1.0))
      >>> problem = OuterProblem(closed.jaxpr, [{0}, {0}, {1}, {0, 1}], [{0}, {0}, {1}, {0, 1}],
      ...                        ["a", "b", "c", "s"], jax.devices()[:2], lambda j, q: None)
      >>> levels = level_equations(assign_meshes(problem, {}, region_at=len(closed.eqns)))
      >>> print(levels)  # doctest: +ELLIPSIS
      pre.L0.mesh0: 0:mul 1:mul 2:add 3:sqrt 4:mul 5:sub 6:mul 7:mul ... 12:mul 19:add
      pre.L0.mesh1: 13:mul 14:mul 15:add 16:sqrt 17:mul 18:sub
      ...
      >>> print(split_common_parts(levels))  # doctest: +ELLIPSIS
      pre.L0.mesh0: 6:mul 7:mul 8:add 9:sqrt 10:mul 11:sub 12:mul 19:add
      pre_common.L0.mesh0: 0:mul 1:mul 2:add 3:sqrt 4:mul 5:sub
      pre_common.L0.mesh1: 13:mul 14:mul 15:add 16:sqrt 17:mul 18:sub
      ...
    """
    eqns = levels.assignment.jaxpr.eqns
    senders = {t.source for t in levels.transfers if isinstance(t, PackedTransfer)}
    families: dict[tuple[Any, int], list[OuterGroup]] = {}
    for group, members in levels.groups.items():
        if group.part is not Part.WHOLE or group in senders:
            continue
        if not any(eqns[i].effects for i in members):
            families.setdefault((group.segment, group.level), []).append(group)
    groups = dict(levels.groups)
    for family in families.values():
        names: dict[Any, int] = {}
        pieces = {g: _pieces(eqns, levels.groups[g], names) for g in family}
        core = _core(family, pieces)
        if core is None:
            core = _wired_apart(eqns, family, pieces, levels.groups)
        orders = {}
        for group in family if core is not None else ():
            assert core is not None  # for the type checker: the loop is empty otherwise
            order = _match(pieces[core], pieces[group])
            if order is not None:
                orders[group] = order
        joined = _prologue_joins_common(eqns, pieces, orders)
        for group, order in orders.items():
            del groups[group]
            taken = set(order)
            rest = [i for k, p in enumerate(pieces[group].pieces) if k not in taken for i in p]
            common = [i for k in order for i in pieces[group].pieces[k]]
            prologue = list(pieces[group].prologue)
            if joined:  # every mesh's common part computes it: no program of its own
                common, prologue = prologue + common, []
            # The prologue runs with the rest where there is one: a module less to compile.
            parts = {
                Part.PROLOGUE: [] if rest else prologue,
                Part.WHOLE: sorted(rest + prologue) if rest else [],
                Part.COMMON: common,
            }
            for part, members in parts.items():
                if members:
                    groups[dataclasses.replace(group, part=part)] = tuple(members)
    if groups.keys() == levels.groups.keys():
        return levels
    return dataclasses.replace(levels, groups={g: groups[g] for g in sorted(groups)})


def _prologue_joins_common(
    eqns: Sequence[Any],
    pieces: Mapping[OuterGroup, _Pieces],
    orders: Mapping[OuterGroup, list[int]],
) -> bool:
    """Whether each split program's prologue can run inside its common part.

    True when there are two or more split programs, each prologue is non-empty, the
    rest of each program reads none of the prologue's values (the rest may run first),
    and the common parts stay equal with the prologue added (the step count of an
    optimizer whose updates do not read it). Then no ``post_prologue`` program is
    compiled.
    """
    if len(orders) < 2:
        return False
    keys = set()
    for group, order in orders.items():
        prologue = pieces[group].prologue
        if not prologue:
            return False
        made = {o for i in prologue for o in eqns[i].outvars}
        taken = set(order)
        for k, piece in enumerate(pieces[group].pieces):
            reads = (v for i in piece for v in eqns[i].invars if not is_literal(v))
            if k not in taken and any(v in made for v in reads):
                return False
        common = [*prologue, *(i for k in order for i in pieces[group].pieces[k])]
        keys.add(_slice_key(eqns, common))
    return len(keys) == 1 and None not in keys


def _pieces(eqns: Sequence[Any], members: Sequence[int], names: dict[Any, int]) -> _Pieces:
    """The prologue of a program's equations, and its independent pieces.

    ``names`` numbers what prologue values compute (shared by the programs
    compared, so that equal prologue work has one number on every mesh).
    """
    defined: dict[Any, int] = {}
    small: set[int] = set()  # small equations that read only inputs and small equations
    for i in members:
        e = eqns[i]
        reads = [v for v in e.invars if not is_literal(v)]
        if (
            not e.effects
            and all(var_bytes(v) <= _PROLOGUE_BYTES for v in (*reads, *e.outvars))
            and all(v not in defined or defined[v] in small for v in reads)
        ):
            small.add(i)
        defined.update((o, i) for o in e.outvars)
    # The prologue: the small equations that compute scalars, and what they read.
    wanted: set[Any] = set()
    prologue = []
    for i in reversed(members):
        outs = eqns[i].outvars
        if i in small and any(not o.aval.shape or o in wanted for o in outs):
            prologue.append(i)
            wanted.update(v for v in eqns[i].invars if not is_literal(v))
    prologue.reverse()
    in_prologue = set(prologue)
    value_name: dict[Any, Any] = {}  # prologue value -> the number of what computes it
    for i in prologue:
        reads = [v for v in eqns[i].invars if not is_literal(v)]
        what = _equation_key(eqns[i], [value_name.get(v) for v in reads])
        for k, o in enumerate(eqns[i].outvars):
            value_name[o] = names.setdefault((what, k), len(names))
    parent = {i: i for i in members if i not in in_prologue}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in parent:
        for v in eqns[i].invars:
            j = None if is_literal(v) else defined.get(v)
            if j is not None and j in parent:
                parent[find(i)] = find(j)
    by_root: dict[int, list[int]] = {}
    for i in members:
        if i in parent:
            by_root.setdefault(find(i), []).append(i)
    pieces = tuple(tuple(p) for p in by_root.values())
    keys = tuple(_piece_key(eqns, piece, value_name) for piece in pieces)
    return _Pieces(tuple(prologue), pieces, keys)


def _equation_key(eqn: Any, read: Sequence[Any]) -> Any:
    """What one prologue equation computes: itself, and the prologue values it reads."""
    inputs = list(dict.fromkeys(v for v in eqn.invars if not is_literal(v)))
    return structure_key([eqn], inputs, eqn.outvars), tuple(read)


def _piece_key(eqns: Sequence[Any], piece: Sequence[int], value_name: Mapping[Any, int]) -> Any:
    """What ``piece`` computes, and which prologue values (by what computes them) it reads."""
    body = [eqns[i] for i in piece]
    outs = [o for e in body for o in e.outvars]
    _, free = make_subprogram(body, outs)
    key = structure_key(body, free, outs)
    return None if key is None else (key, tuple(value_name.get(v) for v in free))


def _core(family: Sequence[OuterGroup], pieces: Mapping[OuterGroup, _Pieces]) -> Any:
    """The program with the fewest pieces that another one contains with more, or None."""
    counts = {g: collections.Counter(pieces[g].keys) for g in family}
    candidates = []
    for g in family:
        if None in counts[g] or sum(len(p) for p in pieces[g].pieces) < _MIN_COMMON_EQUATIONS:
            continue
        bigger = [h for h in family if h != g and counts[h] > counts[g]]  # strict multiset superset
        if bigger:
            candidates.append((len(pieces[g].pieces), g))
    return min(candidates)[1] if candidates else None


def _wired_apart(
    eqns: Sequence[Any],
    family: Sequence[OuterGroup],
    pieces: Mapping[OuterGroup, _Pieces],
    groups: Mapping[OuterGroup, Sequence[int]],
) -> OuterGroup | None:
    """The first of 3+ programs equal piece by piece and in prologue, not as wholes; or None.

    With a global-norm clip each mesh receives the small gradients of all the
    others and updates its own one: programs equal piece by piece, but each reads
    its own value at another argument, so no two share an executable. Split, the
    prologues (the norm, read in one order everywhere) and the common parts are equal.
    """
    # Executables are shared within one process only (`nnx_mpmd.aot.program_sharing`):
    # with several, each mesh would compile two programs instead of one.
    if len(family) < 3 or jax.process_count() > 1:
        return None
    first = collections.Counter(pieces[family[0]].keys)
    if None in first or sum(len(p) for p in pieces[family[0]].pieces) < _MIN_COMMON_EQUATIONS:
        return None
    if any(collections.Counter(pieces[g].keys) != first for g in family[1:]):
        return None
    prologues = {_slice_key(eqns, pieces[g].prologue) for g in family}
    wholes = {_slice_key(eqns, groups[g]) for g in family}
    if len(prologues) != 1 or None in prologues or len(wholes) == 1 or None in wholes:
        return None
    return family[0]


def _slice_key(eqns: Sequence[Any], members: Sequence[int]) -> Any:
    """`structure_key` of the equations ``members`` with all their results."""
    body = [eqns[i] for i in members]
    outs = [o for e in body for o in e.outvars]
    _, free = make_subprogram(body, outs)
    return structure_key(body, free, outs)


def _match(core: _Pieces, other: _Pieces) -> list[int] | None:
    """For each of the core's pieces in order, an equal piece of ``other`` (indices), or None."""
    free: dict[Any, collections.deque[int]] = {}
    for k, key in enumerate(other.keys):
        free.setdefault(key, collections.deque()).append(k)
    order = []
    for key in core.keys:
        if not free.get(key):
            return None
        order.append(free[key].popleft())
    return order
