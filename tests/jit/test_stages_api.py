"""``lower()`` has no side effects; ``Lowered`` shows every pass; ``Compiled`` runs and reports.

Like ``jax.stages``: ``f.trace(*args)`` -> `Traced` -> ``.lower()`` -> `Lowered` (passes,
instructions, programs) -> ``.compile()`` -> `Compiled` (callable, XLA memory and cost
analyses), each made once per input signature; the lowered IR never changes after.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import MLP, WIDTH, make_mesh, mlp_loss, train_step_fn

import nnx_mpmd as mp
from nnx_mpmd.compiler.ir import Call, format_instructions


def _setup(schedule=None, stages=2):
    model = MLP(stages, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = mp.jit(
        train_step_fn(mlp_loss),
        mesh=make_mesh(2, 2),
        schedule=schedule or mp.OneFOneB(),
        num_microbatches=4,
    )
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(8, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(8, WIDTH)).astype(np.float32),
    }
    return model, opt, step, batch


def _leaves(*nodes):
    return jax.tree.leaves(nnx.state(nodes))


def test_lower_moves_no_state_and_the_call_reuses_its_lowering():
    model, opt, step, batch = _setup()
    before = _leaves(model, opt)
    lowered = step.lower(model, opt, batch)
    after = _leaves(model, opt)
    assert all(a is b for a, b in zip(before, after, strict=True))  # nothing placed
    assert not any(isinstance(x, mp.MpmdArray) for x in after)
    assert step.num_compiled_steps == 1
    step(model, opt, batch)  # places the state, then finds the lowering in the cache
    assert step.num_compiled_steps == 1
    assert any(isinstance(x, mp.MpmdArray) for x in _leaves(model, opt))
    assert lowered.ir_text() == step.lower(model, opt, batch).ir_text()
    assert step.num_compiled_steps == 1


@pytest.mark.parametrize(
    "schedule,expected",
    [
        (mp.OneFOneB(), ["trace", "cut_stages", "stage_vjp", "schedule"]),
        (mp.ZeroBubbleH1(), ["trace", "cut_stages", "stage_vjp", "split_backward", "schedule"]),
    ],
    ids=["1f1b", "zb-h1"],
)
def test_lowered_shows_the_ir_after_every_pass(schedule, expected):
    model, opt, step, batch = _setup(schedule)
    lowered = step.lower(model, opt, batch)
    names = [record.name for record in lowered.passes]
    assert names[: len(expected)] == expected
    assert names[-6:] == [
        "insert_frees",
        "donate_dead_arguments",
        "schedule_ticks",
        "batch_transfers",
        "merge_frees",
        "dedupe_programs",
    ]
    assert lowered.pass_text("merge_frees") == lowered.ir_text()
    assert lowered.pass_text("dedupe_programs").splitlines() == sorted(lowered.programs)
    assert "stage 1:" in lowered.pass_text("cut_stages")
    assert "mesh 0:" in lowered.pass_text("schedule")


def test_an_unknown_pass_name_lists_the_passes():
    model, opt, step, batch = _setup()
    with pytest.raises(KeyError, match=r"no lowering pass named 'nope'; the passes were: trace"):
        step.lower(model, opt, batch).pass_text("nope")


def test_inference_steps_are_told_apart_by_the_trace_not_by_an_error():
    model, _, _, batch = _setup()
    forward = mp.jit(
        lambda m, x: m(x), mesh=make_mesh(2, 2), schedule=mp.GPipe(), num_microbatches=4
    )
    expected = np.asarray(model(batch["x"]))  # before the step places the model
    lowered = forward.lower(model, batch["x"])
    assert [r.name for r in lowered.passes][:2] == ["trace", "cut_stages"]
    np.testing.assert_allclose(np.asarray(forward(model, batch["x"])), expected, rtol=1e-5)


def test_stages_called_inside_and_outside_the_region_are_an_error():
    model, opt, _, batch = _setup()

    def step(model, opt, batch):
        loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
        opt.update(model, grads)
        return loss, model(batch["x"])

    f = mp.jit(step, mesh=make_mesh(2, 2), schedule=mp.GPipe(), num_microbatches=4)
    with pytest.raises(mp.PartitionError, match=r"Stage 0.*outside mp.value_and_grad"):
        f.lower(model, opt, batch)


def test_compiled_runs_the_step_and_reports_xla_analyses():
    model, opt, step, batch = _setup()
    reference_model, reference_opt, reference_step, _ = _setup()
    compiled = step.lower(model, opt, batch).compile()
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    assert {"F0", "B0", "FB1"} <= set(memory) and set(memory) == set(cost)
    assert memory["F0"].argument_size_in_bytes > 0
    assert cost["FB1"]["flops"] > 0
    loss = compiled(model, opt, batch)
    assert step.num_compiled_steps == 1
    expected = reference_step(reference_model, reference_opt, batch)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert compiled.as_text() == compiled.lowered.as_text()


def _counting(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_trace_lower_and_compile_are_each_made_once(monkeypatch):
    from nnx_mpmd.jit import programs, stages

    lowerings = _counting(monkeypatch, stages, "compile_step")
    compilations = _counting(monkeypatch, programs, "start_precompile")
    model, opt, step, batch = _setup()
    traced = step.trace(model, opt, batch)
    assert isinstance(traced, mp.Traced)
    lowered = traced.lower()
    assert traced.lower() is lowered
    assert step.lower(model, opt, batch) is lowered  # lower() is trace().lower()
    compiled = lowered.compile()
    assert lowered.compile() is compiled
    step(model, opt, batch)  # places the state; finds the lowering and its programs
    step(model, opt, batch)
    assert step.lower(model, opt, batch).compile() is compiled
    assert (len(lowerings), len(compilations), step.num_compiled_steps) == (1, 1, 1)


def test_traced_owns_its_jaxpr_and_lowering_traces_no_more(monkeypatch):
    from nnx_mpmd.compiler.final import step as final_step

    traces = _counting(monkeypatch, final_step, "trace_step")
    model, opt, step, batch = _setup()
    traced = step.trace(model, opt, batch)
    assert traces == []  # traced on first use, not when the arguments are read
    jaxpr = traced.jaxpr
    assert traced.jaxpr is jaxpr and len(traces) == 1
    lowered = traced.lower()
    assert len(traces) == 1  # the passes run on the Traced's jaxpr
    assert lowered.pass_text("trace") == str(jaxpr)
    ref_model, ref_opt, _, _ = _setup()
    loss = step(model, opt, batch)
    expected = nnx.jit(train_step_fn(mlp_loss))(ref_model, ref_opt, batch)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
    assert len(traces) == 1


def test_a_first_call_reads_and_places_its_arguments_once(monkeypatch):
    from nnx_mpmd.jit import arguments
    from nnx_mpmd.placement import abstract, place

    flattened = _counting(monkeypatch, arguments, "flatten_step_args")
    decided = _counting(monkeypatch, place, "placement_decisions")
    monkeypatch.setattr(abstract, "placement_decisions", place.placement_decisions)
    model, opt, step, batch = _setup()
    reference_model, reference_opt, _, _ = _setup()
    loss = step(model, opt, batch)  # unplaced state: placed, then lowered and run
    assert (len(flattened), len(decided)) == (1, 1)
    assert any(isinstance(x, mp.MpmdArray) for x in _leaves(model, opt))
    expected = nnx.jit(train_step_fn(mlp_loss))(reference_model, reference_opt, batch)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


def test_the_ir_is_not_changed_by_compiling_or_running():
    model, opt, step, batch = _setup()
    lowered = step.lower(model, opt, batch)
    text, instructions = lowered.ir_text(), lowered.compiled.instructions
    fields = dict(vars(lowered.compiled))
    functions = [ins.fn for ins in instructions if isinstance(ins, Call)]
    compiled = lowered.compile()
    step(model, opt, batch)
    compiled(model, opt, batch)
    assert lowered.compiled.instructions is instructions
    assert [ins.fn for ins in instructions if isinstance(ins, Call)] == functions
    assert lowered.ir_text() == text
    routed = compiled.bound_programs.step  # the copy whose calls go to the executables
    assert routed is not lowered.compiled and format_instructions(routed.instructions) == text
    # No runtime cache hangs on either IR: `Compiled` owns its prepared steps.
    assert vars(lowered.compiled) == fields and vars(routed).keys() == fields.keys()
    with pytest.raises(dataclasses.FrozenInstanceError):
        routed.instructions = []  # type: ignore[misc]


def test_compiled_runs_by_itself_and_compiles_nothing_more(monkeypatch):
    from nnx_mpmd.aot.stats import count_compilations

    model, opt, step, batch = _setup()
    reference_model, reference_opt, _, _ = _setup()
    reference = nnx.jit(train_step_fn(mlp_loss))
    compiled = step.lower(model, opt, batch).compile()

    def no_step_call(*args, **kwargs):
        raise AssertionError("Compiled went back through the PipelinedFunction")

    monkeypatch.setattr(mp.PipelinedFunction, "__call__", no_step_call)
    with count_compilations() as counted:
        losses = [float(compiled(model, opt, batch)) for _ in range(2)]
    assert counted.count == 0
    expected = [float(reference(reference_model, reference_opt, batch)) for _ in range(2)]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for got, want in zip(_leaves(model), _leaves(reference_model), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_compiled_called_with_other_argument_types_is_an_error():
    model, opt, step, batch = _setup()
    compiled = step.lower(model, opt, batch).compile()
    wider = {name: np.concatenate([value, value]) for name, value in batch.items()}
    with pytest.raises(
        mp.CompileError, match=r"compiled for other argument types.*call the mp.jit"
    ):
        compiled(model, opt, wider)
    assert jnp.isfinite(step(model, opt, wider))


def test_options_are_one_frozen_checked_object():
    from nnx_mpmd.jit.options import JitOptions

    step = _setup()[2]
    assert isinstance(step.options, JitOptions)
    assert step.options.num_microbatches == step.num_microbatches == 4
    assert step.options.batch_axis == step.batch_axis == "data"
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.options.num_microbatches = 2  # type: ignore[misc]
    kwargs = {"mesh": make_mesh(2, 2), "schedule": mp.GPipe()}
    with pytest.raises(mp.CompileError, match="num_microbatches must be an int >= 1, got 0"):
        mp.jit(num_microbatches=0, **kwargs)  # checked when jit is called, before decorating
    with pytest.raises(mp.CompileError, match="compile_threads must be an int >= 1 or None"):
        mp.jit(train_step_fn(mlp_loss), num_microbatches=2, compile_threads=0, **kwargs)
    with pytest.raises(mp.CompileError, match=r"donate_argnums=\.\.\.\) takes argument positions"):
        mp.jit(num_microbatches=2, donate_argnums=(-1,), **kwargs)
    with pytest.raises(mp.CompileError, match=r"static_argnames=\.\.\.\) names \['nope'\]"):
        mp.jit(train_step_fn(mlp_loss), num_microbatches=2, static_argnames="nope", **kwargs)


def test_instructions_list_a_receive_for_every_member_of_a_transfer_batch():
    from nnx_mpmd.compiler.ir import Transfer, TransferBatch

    model = MLP(4, rngs=nnx.Rngs(0))  # 4 meshes: a tick moves activations and cotangents
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = mp.jit(
        train_step_fn(mlp_loss), mesh=make_mesh(4, 2), schedule=mp.OneFOneB(), num_microbatches=4
    )
    batch = {"x": np.ones((8, WIDTH), np.float32), "y": np.ones((8, WIDTH), np.float32)}
    lowered = step.lower(model, opt, batch)
    moves = []
    for ins in lowered.compiled.instructions:
        if isinstance(ins, TransferBatch):
            moves.extend(ins.transfers)
        elif isinstance(ins, Transfer):
            moves.append(ins)
    assert any(isinstance(ins, TransferBatch) for ins in lowered.compiled.instructions)
    receives = [line for line in lowered.instructions() if ": receive " in line]
    assert len(receives) == len(moves)
    text = lowered.as_text()
    for move in moves:
        assert f"receive {move.label} ({move.nbytes} B)" in text
