"""Each distinct program compiles once: equal stages on equal submeshes share an executable."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import (
    WIDTH,
    build,
    lm_on_four_meshes,
    make_batch,
    make_mesh,
    mlp_loss,
    params_of,
    train_step_fn,
)

import nnx_mpmd as mp
from nnx_mpmd.aot import program_sharing
from nnx_mpmd.aot.program_sharing import SharedProgram, load_for_devices, share_key
from nnx_mpmd.aot.stats import count_compilations


def _submesh(ids, names=("data",)):
    devices = np.array([jax.devices()[i] for i in ids]).reshape(len(ids), *[1] * (len(names) - 1))
    return jax.sharding.Mesh(devices, names)


def _reduce(w, x):
    y = jnp.tanh(x @ w)
    return y, jnp.sum(y, axis=0), jnp.sum(y)  # all-reduces over the data axis


def _args(mesh, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    return (
        jax.device_put(w, NamedSharding(mesh, P())),
        jax.device_put(x, NamedSharding(mesh, P("data"))),
    )


@pytest.mark.parametrize("target_ids", [(2, 3), (7, 4)], ids=["in-order", "reversed-ids"])
def test_a_loaded_executable_runs_on_the_target_devices_in_their_order(target_ids, compiled_here):
    source, target = _submesh((0, 1)), _submesh(target_ids)
    fn = jax.jit(_reduce)
    compiled = fn.lower(*_args(source)).compile()
    assert program_sharing.runs_on(compiled, source)
    loaded = load_for_devices(compiled, source, target)
    args = _args(target, seed=1)
    with count_compilations() as counter:
        got = loaded(*args)
    assert counter.count == 0
    want = fn(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert g.sharding == w.sharding
        assert [s.device for s in g.addressable_shards] == [s.device for s in w.addressable_shards]


def test_loading_on_a_submesh_of_another_shape_is_an_error():
    source = _submesh((0, 1))
    compiled = jax.jit(_reduce).lower(*_args(source)).compile()
    with pytest.raises(mp.CompileError, match=r"differ in axis names, sizes or types"):
        load_for_devices(compiled, source, _submesh((2, 3, 4, 5)))
    with pytest.raises(mp.CompileError, match=r"compile it for that submesh instead"):
        load_for_devices(compiled, source, _submesh((2, 3), names=("model",)))


def test_share_key_ignores_only_the_module_name():
    mesh = _submesh((0, 1))
    a = jax.jit(_reduce).lower(*_args(mesh)).as_text()
    renamed = a.replace("module @jit__reduce", "module @jit_other", 1)
    assert a != renamed and share_key(a, mesh) == share_key(renamed, mesh)
    donated = jax.jit(_reduce, donate_argnums=1).lower(*_args(mesh)).as_text()
    assert share_key(donated, mesh) != share_key(a, mesh)
    assert share_key(a, _submesh((0, 1), names=("model",))) != share_key(a, mesh)
    assert share_key(a, None) is None
    assert share_key("func.func @main", mesh) is None


@pytest.mark.fallback_compiles  # what this test checks
def test_a_shared_program_with_other_arguments_runs_its_own_function():
    source, target = _submesh((0, 1)), _submesh((2, 3))
    fn = jax.jit(_reduce)
    loaded = load_for_devices(fn.lower(*_args(source)).compile(), source, target)
    shared = SharedProgram(fn, [loaded])
    on_target = _args(target)
    np.testing.assert_array_equal(shared(*on_target)[2], fn(*on_target)[2])
    assert shared.loaded == [loaded]
    elsewhere = _args(_submesh((4, 5)))  # other devices: the check fails before running
    np.testing.assert_array_equal(shared(*elsewhere)[2], fn(*elsewhere)[2])
    assert shared.loaded == [loaded] and "1 loaded" in repr(shared)


def test_equal_middle_stages_compile_once_and_match_nnx_jit(compiled_here):
    # Stages 1 and 2 are the same block on equal 2-device submeshes: their F, B,
    # init and update programs are the same modules.
    model, opt, loss_fn, kind = build("lm", "adamw", 4)
    ref_model, ref_opt, _, _ = build("lm", "adamw", 4)
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(4, 2, jax.sharding.AxisType.Auto),
        schedule=mp.OneFOneB(),
        num_microbatches=2,
    )
    batch = make_batch(kind, 8)
    with count_compilations() as first:
        lowered = step.lower(model, opt, batch)
        compiled = lowered.compile()
    named = compiled.executables()
    assert set(named) == set(lowered.programs)
    distinct = {id(e) for found in named.values() for e in found}
    assert first.count < len(lowered.programs) <= len(distinct)
    assert {"F1", "F2", "B1", "B2"} <= set(lowered.programs)
    # The Compiled runs a routed copy of the step; the lowered IR keeps its jitted functions.
    routed = compiled.bound_programs.step.instructions
    shared = {type(ins.fn).__name__ for ins in routed if hasattr(ins, "fn")}
    assert "SharedProgram" in shared
    assert "SharedProgram" not in {
        type(ins.fn).__name__ for ins in lowered.compiled.instructions if hasattr(ins, "fn")
    }
    # The update programs of meshes 1 and 2 are twins: equal structure keys. Mesh 0's
    # update shares only its common part with them (outer_parts.split_common_parts).
    calls = {str(c.program): c for c in lowered.compiled.instructions if hasattr(c, "structure")}
    updates = sorted(name for name in calls if name.startswith("post") and "mesh1" in name)
    assert any(name.startswith("post_common.") for name in updates), sorted(calls)
    for name in updates:
        twin = calls[name.replace("mesh1", "mesh2")]
        assert calls[name].structure is not None and calls[name].structure == twin.structure
        on_0 = calls.get(name.replace("mesh1", "mesh0"))
        if on_0 is not None:
            common = name.startswith("post_common.")
            assert (on_0.structure == twin.structure) == common, name

    ref_step = nnx.jit(train_step_fn(loss_fn, num_microbatches=2))
    with count_compilations() as runs:
        losses = [float(step(model, opt, make_batch(kind, 8, seed=s))) for s in (0, 1)]
    assert runs.count == 0  # nothing compiles again, loaded programs included
    want = [float(ref_step(ref_model, ref_opt, make_batch(kind, 8, seed=s))) for s in (0, 1)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got, ref = params_of(mp.gather(model)), params_of(ref_model)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


class _Layers(mp.PipelinedModel):
    """One Linear + activation per stage: ``acts[k]`` is stage k's activation."""

    def __init__(self, acts, remat=(), *, rngs):
        self.layers = nnx.List(
            [
                mp.Stage(nnx.Linear(16, 16, rngs=rngs), stage=k, remat=k in remat)
                for k in range(len(acts))
            ]
        )
        self.acts = acts

    def __call__(self, x):
        for layer, act in zip(self.layers, self.acts):
            x = act(layer(x))
        return x


def _counting_stage_traces(monkeypatch):
    """Counts, per (program kind, stage), how often a stage program is traced."""
    from collections import Counter

    from nnx_mpmd.compiler.trace.stage_programs import StageFunctions

    traced = Counter()
    for method in ("forward", "backward", "fused", "init"):
        original = getattr(StageFunctions, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            traced[(_method, self.stage)] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(StageFunctions, method, counted)
    return traced


@pytest.mark.parametrize("axis_types", [None, jax.sharding.AxisType.Auto], ids=["explicit", "auto"])
def test_equal_middle_stages_are_traced_once_and_match_nnx_jit(
    monkeypatch, axis_types, compiled_here
):
    # Stages 1 and 2 are the same program: one of them is traced and lowered, the
    # other loads its executable (Call.structure), before and after donation.
    # (compiled_here: an executable from JAX's disk cache cannot be serialized for
    # the twin, which then traces and compiles itself.)
    traced = _counting_stage_traces(monkeypatch)
    step, (model, opt), (ref_model, ref_opt), loss_fn, kind = lm_on_four_meshes("adamw", axis_types)
    lowered = step.lower(model, opt, make_batch(kind, 8))
    calls = {c.label: c for c in lowered.compiled.instructions if hasattr(c, "structure")}
    assert calls["F1.0"].structure is not None
    assert calls["F1.0"].structure == calls["F2.0"].structure != calls["F0.0"].structure
    assert calls["B1.0"].structure == calls["B2.0"].structure != calls["F1.0"].structure
    ref_step = nnx.jit(train_step_fn(loss_fn, num_microbatches=4))
    losses = [float(step(model, opt, make_batch(kind, 8, seed=s))) for s in (0, 1)]
    assert traced[("forward", 1)] + traced[("forward", 2)] == 1, traced
    assert traced[("backward", 1)] + traced[("backward", 2)] == 1, traced
    assert traced[("forward", 0)] == 1 and traced[("fused", 3)] == 1, traced
    want = [float(ref_step(ref_model, ref_opt, make_batch(kind, 8, seed=s))) for s in (0, 1)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    got, ref = params_of(mp.gather(model)), params_of(ref_model)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "acts, remat",
    [
        ((jnp.tanh, jnp.tanh, jax.nn.relu, jnp.tanh), ()),  # another activation
        ((jnp.tanh,) * 4, (2,)),  # the same layer, rematerialized
    ],
    ids=["activation", "remat"],
)
def test_stages_that_differ_only_inside_are_not_twins(monkeypatch, acts, remat):
    # Equal shapes everywhere: only the equations (or the remat policy) tell the
    # middle stages apart. Each must run its own program.
    traced = _counting_stage_traces(monkeypatch)
    model = _Layers(acts, remat, rngs=nnx.Rngs(0))
    ref_model = _Layers(acts, remat, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)

    def loss_fn(m, batch):
        return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(4, 2), schedule=mp.OneFOneB(), num_microbatches=4
    )
    batch = {
        "x": np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32),
        "y": np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32),
    }
    lowered = step.lower(model, opt, batch)
    calls = {c.label: c for c in lowered.compiled.instructions if hasattr(c, "structure")}
    first, second = calls["F1.0"].structure, calls["F2.0"].structure
    assert first is None or first != second
    loss = float(step(model, opt, batch))
    assert traced[("forward", 1)] == traced[("forward", 2)] == 1, traced
    want = float(nnx.jit(train_step_fn(loss_fn, num_microbatches=4))(ref_model, ref_opt, batch))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    got, ref = params_of(mp.gather(model)), params_of(ref_model)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _dualpipev_first_step(monkeypatch, twins):
    """(traces of stage functions, loss, model) of DualPipeV's first step, 8 stages."""
    from nnx_mpmd.compiler.trace.stage_programs import StageFunctions

    with monkeypatch.context() as patch:
        if not twins:
            patch.setattr(StageFunctions, "structure", lambda self, kind: None)
        traced = _counting_stage_traces(patch)
        model, opt, loss_fn, kind = build("lm", "adamw", 8)
        step = mp.jit(
            train_step_fn(loss_fn),
            mesh=make_mesh(4, 1),
            schedule=mp.DualPipeV(),
            num_microbatches=8,
        )
        lowered = step.lower(model, opt, make_batch(kind, 16))
        pairs = {}
        for c in lowered.compiled.instructions:
            if "+" in getattr(c, "label", ""):
                pairs.setdefault(c.mesh, set()).add(c.structure)
        loss = float(step(model, opt, make_batch(kind, 16)))
    return sum(traced.values()), pairs, loss, model


def test_equal_overlapped_pairs_are_traced_once(monkeypatch, compiled_here):
    # DualPipeV runs a forward and a backward of two stages as one program; on
    # meshes 1 and 2 those pairs hold equal blocks, so one pair is traced.
    traces, pairs, loss, model = _dualpipev_first_step(monkeypatch, twins=True)
    assert None not in pairs[1] and pairs[1] == pairs[2], pairs
    program_sharing.forget_kept()
    plain_traces, _, plain_loss, plain_model = _dualpipev_first_step(monkeypatch, twins=False)
    assert traces < plain_traces
    assert loss == plain_loss
    got, want = params_of(mp.gather(model)), params_of(mp.gather(plain_model))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_backward_traced_before_any_forward_of_its_stage_finds_its_residual_layout():
    # A backward whose forward ran an equal stage's executable (never traced for
    # this stage's StageFunctions) traces the forward abstractly for the layout.
    from nnx_mpmd.compiler.trace.stage_programs import StageFunctions

    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    lowered = step.lower(model, opt, make_batch(kind, 4))
    plan = lowered.compiled.plan
    calls = [
        c for c in lowered.compiled.instructions if getattr(c, "label", "") in ("F0.0", "B0.0")
    ]
    assert [c.label for c in calls] == ["F0.0", "B0.0"]
    traced_here = StageFunctions(plan, 0)
    never_traced = StageFunctions(plan, 0)
    forward_args = _abstract_forward_args(traced_here, plan)
    sends, kept, _, _ = jax.eval_shape(traced_here.forward, *forward_args)
    cts = tuple((s,) for s in sends)
    gacc = tuple(forward_args[0])
    inputs = forward_args[:6]
    want = jax.eval_shape(traced_here.backward, kept, inputs, cts, gacc)
    got = jax.eval_shape(never_traced.backward, kept, inputs, cts, gacc)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert [a.shape for a in jax.tree.leaves(got)] == [a.shape for a in jax.tree.leaves(want)]


def _abstract_forward_args(fns, plan):
    body = plan.info.body

    def of(r):
        return jax.ShapeDtypeStruct(body.invars[r].aval.shape, body.invars[r].aval.dtype)

    m = plan.info.num_microbatches  # a batch input holds every microbatch
    batch = tuple(jax.ShapeDtypeStruct((m, *of(r).shape), of(r).dtype) for r in fns.batch_inputs)
    racc = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in fns.accumulated)
    return (
        tuple(of(r) for r in fns.param_inputs),
        tuple(of(r) for r in fns.rest_inputs),
        batch,
        jax.ShapeDtypeStruct((), jnp.int32),
        tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in fns.xd),
        tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in fns.xn),
        racc,
    )


def test_a_fresh_executable_is_recalled_from_the_cache_directory(monkeypatch, tmp_path):
    before = jax.config.jax_compilation_cache_dir  # (JAX's own cache keeps its directory)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        _recall_from_the_directory(monkeypatch, tmp_path)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def _recall_from_the_directory(monkeypatch, tmp_path):
    import collections
    import pickle

    source, target = _submesh((0, 1)), _submesh((6, 7))
    fn = jax.jit(_reduce)
    key = ("test-recall", share_key(fn.lower(*_args(source)).as_text(), source))
    program_sharing.remember(
        key, program_sharing.serialized(fn.lower(*_args(source)).compile(), source)
    )
    monkeypatch.setattr(program_sharing, "_REMEMBERED", collections.OrderedDict())
    stored = program_sharing.recall(key)  # from the file: a later process's view
    assert stored is not None and list(tmp_path.glob(f"{program_sharing._STORE_FOLDER}/*.pkl"))
    got = program_sharing.load_serialized(stored, target)(*_args(target))
    np.testing.assert_array_equal(got[2], fn(*_args(target))[2])
    # A file whose stored key differs (another jax, other XLA flags...) is never used.
    path = program_sharing._stored_path(key)
    path.write_bytes(pickle.dumps((("another key",), stored)))
    monkeypatch.setattr(program_sharing, "_REMEMBERED", collections.OrderedDict())
    assert program_sharing.recall(key) is None


@pytest.mark.fallback_compiles  # what this test checks
def test_an_executable_compiled_for_other_explicit_types_is_not_used():
    # "model" has size 1: P("data", None) and P("data", "model") are one device
    # layout, which XLA accepts, but another type, which the results would carry.
    mesh = jax.make_mesh((2, 1), ("data", "model"), devices=jax.devices()[:2])
    typed = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    x = jax.device_put(np.ones((4, 8), np.float32), typed(P("data", "model")))
    fn = jax.jit(lambda v: v * 2)
    other = jax.device_put(np.ones((4, 8), np.float32), typed(P("data", None)))
    shared = SharedProgram(fn, [fn.lower(other).compile()])
    assert jax.typeof(shared(x)).sharding.spec == P("data", "model")
    assert shared._chosen[(x.sharding,)] is fn
    assert jax.typeof(shared(other)).sharding.spec == P("data", None)


@pytest.mark.fallback_compiles  # what this test checks
def test_an_unused_argument_of_another_type_is_checked_too():
    # XLA's input_shardings leave out the arguments a program does not read;
    # their types still decide the call's (and so the next program's) types.
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    x = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P("data")))
    unused = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P("data", "model")))
    other = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(mesh, P("data")))
    fn = jax.jit(lambda v, w: v + 1)
    shared = SharedProgram(fn, [fn.lower(x, other).compile()])
    shared(x, unused)
    assert shared._chosen[(x.sharding, unused.sharding)] is fn
    shared(x, other)
    assert shared._chosen[(x.sharding, other.sharding)] is not fn


def test_a_later_step_loads_the_programs_an_earlier_step_compiled_for_another_submesh(
    compiled_here,
):
    # The same model on the first and on the last two of four devices: every program
    # is the same module on equal-shaped submeshes, so the second step compiles none.
    def run(devices):
        model, opt, loss_fn, kind = build("mlp", "adamw", 2)
        jax_mesh = jax.make_mesh((2, 1), ("stage", "data"), devices=devices)
        step = mp.jit(
            train_step_fn(loss_fn),
            mesh=mp.MpmdMesh(jax_mesh, "stage"),
            schedule=mp.OneFOneB(),
            num_microbatches=2,
        )
        with count_compilations() as counter:
            loss = float(step(model, opt, make_batch(kind, 4)))
        return counter.count, loss, params_of(model), step

    # Executables are kept while their step lives (weakly): hold on to the first one.
    first, loss, params, first_step = run(jax.devices()[:2])
    second, again, same, _ = run(jax.devices()[2:4])
    assert first > 0 and second == 0, (first, second)
    assert again == loss  # equal programs, equal inputs: the very same numbers
    for path in params:
        np.testing.assert_array_equal(same[path], params[path], err_msg=path)
    program_sharing.forget_kept()
    third, _, _, _ = run(jax.devices()[4:6])
    assert third == first  # nothing kept: everything compiles again
    del first_step


def test_a_later_process_loads_a_stored_module_instead_of_compiling_it(tmp_path):
    # A process compiles post.L1.mesh1 and loads the equal post.L1.mesh2 from it: only
    # the first has an entry in JAX's persistent cache (the module names differ), so a
    # later process that meets mesh2's module first loads the copy stored beside it.
    from jax.experimental.compilation_cache import compilation_cache

    from nnx_mpmd.aot.compile_jobs import ProgramCompiler, abstract
    from nnx_mpmd.compiler.jaxpr_utils import named_jit

    def outputs(compiler, label, mesh):
        args = abstract(_args(mesh))
        return compiler.outputs(named_jit(_reduce, label), args, lambda _: None, label, mesh)

    first, second = _submesh((0, 1)), _submesh((2, 3))
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()
    try:
        earlier = ProgramCompiler(share=True)
        for label, mesh in (("post.L1.mesh1", first), ("post.L1.mesh2", second)):
            outputs(earlier, label, mesh)
        assert earlier.compiled == 1 and list(earlier.loaded) == ["post.L1.mesh2"]
        program_sharing.forget_kept()  # a later process: nothing kept in memory

        later = ProgramCompiler(share=True)
        with count_compilations() as counter:
            outputs(later, "post.L1.mesh2", second)
        assert counter.count == 0 and later.compiled == 0, counter.count
        (loaded,) = later.loaded["post.L1.mesh2"]
        got, want = loaded(*_args(second, seed=2)), jax.jit(_reduce)(*_args(second, seed=2))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


class _TraceCounter:
    """A jitted function that counts how often it is traced."""

    def __init__(self, label):
        from nnx_mpmd.compiler.jaxpr_utils import named_jit

        self.fn, self.traced = named_jit(_reduce, label), 0

    def trace(self, *args):
        self.traced += 1
        return self.fn.trace(*args)

    def lower(self, *args):
        return self.fn.lower(*args)


def _twins(structure=("reduce",)):
    from nnx_mpmd.aot.compile_jobs import ProgramCompiler, abstract

    compiler = ProgramCompiler(share=True)
    first, second = _submesh((0, 1)), _submesh((2, 3))
    programs = []
    for label, mesh in (("post.L1.mesh1", first), ("post.L1.mesh2", second)):
        program = _TraceCounter(label)
        out = compiler.outputs(
            program, abstract(_args(mesh)), lambda _: None, label, mesh, structure
        )
        programs.append((program, out, mesh))
    return compiler, programs


def test_a_twin_program_loads_its_executable_without_being_traced(compiled_here):
    compiler, [(first, _, _), (second, out, mesh)] = _twins()
    out = out.result()
    assert (first.traced, second.traced) == (1, 0)
    assert compiler.compiled == 1 and list(compiler.loaded) == ["post.L1.mesh2"]
    assert [o.sharding.mesh for o in out] == [mesh] * 3
    (loaded,) = compiler.loaded["post.L1.mesh2"]
    got, want = loaded(*_args(mesh, seed=3)), jax.jit(_reduce)(*_args(mesh, seed=3))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_programs_without_a_structure_are_traced_each(compiled_here):
    compiler, [(first, _, _), (second, _, _)] = _twins(structure=None)
    assert (first.traced, second.traced) == (1, 1)
    assert compiler.compiled == 1  # equal modules: still loaded, after tracing


def test_a_twin_of_a_program_that_cannot_be_shared_compiles_itself(monkeypatch, compiled_here):
    monkeypatch.setattr(program_sharing, "share_key", lambda text, mesh, interface=(): None)
    compiler, [(first, _, _), (second, out, mesh)] = _twins()
    out = out.result() if hasattr(out, "result") else out
    assert (first.traced, second.traced) == (1, 1)
    assert compiler.compiled == 2 and not compiler.loaded
    assert [o.sharding.mesh for o in out] == [mesh] * 3


class _CalledBack(nnx.Module):
    """A Linear plus a value from a Python callback (the module text names it by index)."""

    def __init__(self, value: float, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.value = value

    def __call__(self, x):
        value = self.value
        extra = jax.pure_callback(lambda: np.float32(value), jax.ShapeDtypeStruct((), jnp.float32))
        return jnp.tanh(self.linear(x)) + extra


class _TwoCalledBack(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.first = mp.Stage(_CalledBack(1.0, rngs), stage=0)
        self.second = mp.Stage(_CalledBack(2.0, rngs), stage=1)

    def __call__(self, x):
        return self.second(self.first(x))


def test_equal_programs_with_other_python_callbacks_keep_their_own():
    models = [_TwoCalledBack(nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
    reference = nnx.jit(train_step_fn(mlp_loss, 2))
    step = mp.jit(
        train_step_fn(mlp_loss), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    for i in range(2):
        batch = make_batch("regression", 8, seed=i)
        np.testing.assert_allclose(
            float(step(models[1], optimizers[1], batch)),
            float(reference(models[0], optimizers[0], batch)),
            rtol=1e-6,
        )
