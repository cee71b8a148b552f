"""Models written without nnx_mpmd in mind train unchanged, equal to ``nnx.jit``.

Two habits of published NNX model code: a mutable ``@dataclasses.dataclass``
config (and lists or dicts of settings) kept as module attributes, which Flax
stores in the graphdef as unhashable static values; and parameters annotated
with ``out_sharding`` axes of size 1, or with logical names that sharding
rules map onto the mesh. Each step must equal the same model under
``nnx.jit``, and calls after the first must compile nothing.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import nnx_mpmd as mp
from nnx_mpmd.aot.stats import count_compilations

WIDTH = 8
CALLS = 5


@dataclasses.dataclass
class Config:
    """A plain (mutable, unhashable) config, as most published NNX models keep one."""

    width: int = WIDTH
    scale: float = 1.0
    activation: str = "tanh"


class ConfigLayer(nnx.Module):
    def __init__(self, config: Config, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.linear = nnx.Linear(config.width, config.width, rngs=rngs)
        self.gains = [1.0, 0.5]  # a list of settings: static, unhashable
        self.options = {"residual": [True]}  # a nested dict: static, unhashable

    def __call__(self, x):
        h = getattr(jnp, self.config.activation)(self.linear(x)) * self.config.scale
        return x * self.gains[1] + h if self.options["residual"][0] else h


class ConfigNet(nnx.Module):
    """Layers in an ``nnx.List``; nothing from nnx_mpmd: stages come from `mp.assign_stages`."""

    def __init__(self, num_layers: int, *, rngs: nnx.Rngs) -> None:
        self.config = Config()
        self.layers = nnx.List([ConfigLayer(self.config, rngs=rngs) for _ in range(num_layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.config.scale


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def _batch(seed: int, rows: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, WIDTH)).astype(np.float32)
    return {"x": x, "y": rng.normal(size=(rows, WIDTH)).astype(np.float32)}


def _mesh(num_meshes: int, data: int, kind: AxisType = AxisType.Auto, model: int | None = None):
    shape, names = (num_meshes, data), ("stage", "data")
    if model is not None:
        shape, names = (*shape, model), (*names, "model")
    devices = jax.devices()[: int(np.prod(shape))]
    axes = jax.make_mesh(shape, names, devices=devices, axis_types=(kind,) * len(shape))
    return mp.MpmdMesh(axes, "stage")


def _params(model) -> dict[str, np.ndarray]:
    """Every Param by logical path (without the ``module`` of a `Stage` wrapper)."""
    logical = mp.annotate.logical_paths(model)
    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {
        ".".join(map(str, logical.get(tuple(path), path))): np.asarray(v.get_value())
        for path, v in state
    }


def _assert_params_equal(got, want, atol=1e-5):
    got, want = _params(got), _params(want)
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_allclose(got[path], want[path], atol=atol, err_msg=path)


def _config_pair(num_layers: int):
    """The pipelined model (stages assigned) and its nnx.jit twin, with optimizers."""
    model, twin = ConfigNet(num_layers, rngs=nnx.Rngs(0)), ConfigNet(num_layers, rngs=nnx.Rngs(0))
    mp.assign_stages(model, {f"layers.{i}": i for i in range(num_layers)})
    pair = [(m, nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)) for m in (model, twin)]
    return pair[0], pair[1]


def _run_calls(step, reference, pipelined_args, reference_args, calls, first_seed=0):
    """Calls both steps; losses equal; every call after the first compiles nothing."""
    for i in range(calls):
        batch = _batch(first_seed + i)
        want = reference(*reference_args, batch)
        with count_compilations() as counter:
            got = step(*pipelined_args, batch)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
        if i > 0:
            assert counter.count == 0, f"call {i + 1} compiled {counter.names}"
        assert step.num_compiled_steps == 1


# (schedule, stages, meshes)
SCHEDULES = [(mp.GPipe, 2, 2), (mp.OneFOneB, 3, 3), (mp.Interleaved1F1B, 4, 2)]


@pytest.mark.parametrize(
    "schedule,stages,meshes", SCHEDULES, ids=lambda c: getattr(c, "__name__", c)
)
def test_a_mutable_dataclass_config_trains_like_nnx_jit(schedule, stages, meshes):
    (model, opt), (twin, twin_opt) = _config_pair(stages)
    step = mp.jit(_step, mesh=_mesh(meshes, 1), schedule=schedule(), num_microbatches=4)
    _run_calls(step, nnx.jit(_step), (model, opt), (twin, twin_opt), CALLS)
    _assert_params_equal(model, twin)


def test_a_new_config_compiles_once_more_like_nnx_jit():
    (model, opt), (twin, twin_opt) = _config_pair(2)
    step = mp.jit(_step, mesh=_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2)
    reference = nnx.jit(_step)
    _run_calls(step, reference, (model, opt), (twin, twin_opt), 2)
    for m in (model, twin):  # a new config object with another value: a new program
        m.config = Config(scale=0.5)
    for i in range(3):
        want = reference(twin, twin_opt, _batch(10 + i))
        np.testing.assert_allclose(float(step(model, opt, _batch(10 + i))), float(want), rtol=1e-5)
        assert step.num_compiled_steps == 2
    for m in (model, twin):  # back to the first value: the first program again
        m.config = Config()
    want = reference(twin, twin_opt, _batch(20))
    np.testing.assert_allclose(float(step(model, opt, _batch(20))), float(want), rtol=1e-5)
    assert step.num_compiled_steps == 2
    _assert_params_equal(model, twin)


def test_a_config_changed_in_place_compiles_again():
    """The cache keeps a copy of the config, so a step never runs a program traced for old values.

    (``nnx.jit``'s cache holds the model's own config object, so there a change
    in place is not seen; the reference is therefore a fresh ``nnx.jit``.)
    """
    (model, opt), (twin, twin_opt) = _config_pair(2)
    step = mp.jit(_step, mesh=_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    _run_calls(step, nnx.jit(_step), (model, opt), (twin, twin_opt), 2)
    model.config.scale = twin.config.scale = 0.25  # both layers share the object
    want = nnx.jit(_step)(twin, twin_opt, _batch(5))
    np.testing.assert_allclose(float(step(model, opt, _batch(5))), float(want), rtol=1e-5)
    assert step.num_compiled_steps == 2
    step(model, opt, _batch(6))
    assert step.num_compiled_steps == 2


def test_lower_and_compile_a_model_with_a_mutable_config():
    (model, opt), (twin, twin_opt) = _config_pair(2)
    step = mp.jit(_step, mesh=_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2)
    compiled = step.lower(model, opt, _batch(0)).compile()
    assert compiled.memory_analysis() is not None
    _run_calls(step, nnx.jit(_step), (model, opt), (twin, twin_opt), 3)


def test_checkpoint_round_trip_of_a_model_with_a_mutable_config(tmp_path):
    (model, opt), (twin, twin_opt) = _config_pair(4)
    step = mp.jit(_step, mesh=_mesh(4, 1), schedule=mp.OneFOneB(), num_microbatches=2)
    reference = nnx.jit(_step)
    _run_calls(step, reference, (model, opt), (twin, twin_opt), 2)
    mp.checkpoint.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    # Restored into another split: 4 stages on 2 meshes.
    (restored, restored_opt), _ = _config_pair(4)
    mp.checkpoint.restore(tmp_path / "ckpt", {"model": restored, "optimizer": restored_opt})
    _assert_params_equal(restored, twin)
    other = mp.jit(_step, mesh=_mesh(2, 1), schedule=mp.Interleaved1F1B(), num_microbatches=2)
    _run_calls(other, reference, (restored, restored_opt), (twin, twin_opt), 2, first_seed=2)


class ConfigLM(nnx.Module):
    """A token model with a mutable config, decoded without a KV cache."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.config = Config()
        self.settings = {"vocab": [32]}
        self.embed = nnx.Embed(32, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, 32, rngs=rngs)

    def __call__(self, tokens):
        h = getattr(jnp, self.config.activation)(self.embed(tokens)) * self.config.scale
        return self.head(h)


def test_generator_decodes_a_model_with_a_mutable_config():
    model, twin = ConfigLM(rngs=nnx.Rngs(0)), ConfigLM(rngs=nnx.Rngs(0))
    for m in (model, twin):
        mp.assign_stages(m, {"embed": 0, "head": 1})
    generator = mp.Generator(
        mesh=_mesh(2, 1), schedule=mp.OneFOneB(), num_microbatches=2, window=16
    )
    prompts = np.random.default_rng(0).integers(0, 32, size=(4, 3)).astype(np.int32)
    got = generator(model, prompts, 4)
    want = generator.reference(twin, prompts, 4)
    np.testing.assert_array_equal(got, want)
    generator(model, prompts, 4)
    assert generator.num_compiled_steps == 1


# ------------------------------------------------------------ placements round-trip


class Annotated(nnx.Module):
    """Two layers whose kernels carry ``out_sharding`` metadata (and maybe sharding rules)."""

    def __init__(self, out_sharding, rules, *, rngs: nnx.Rngs) -> None:
        self.a = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.b = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        extra = {"sharding_rules": rules} if rules else {}
        for layer in (self.a, self.b):
            layer.kernel = nnx.Param(
                layer.kernel.get_value(), out_sharding=out_sharding, eager_sharding=False, **extra
            )

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


# (id, mesh (data, model axis size or None), out_sharding, sharding rules, axis kinds).
# A kernel sharded over the batch axis itself (size 2) makes this model's matmuls
# ill-typed on Explicit axes (as under nnx.jit in jax.set_mesh): those run on Auto only.
AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit
ANNOTATIONS = [
    ("size1-data", (1, None), ("data", None), None, (AUTO, EXPLICIT)),
    ("size1-data-cols", (1, None), (None, "data"), None, (AUTO, EXPLICIT)),
    ("size1-model-of-two", (2, 1), (None, "model"), None, (AUTO, EXPLICIT)),
    ("size1-model-in-a-tuple", (2, 1), (("data", "model"), None), None, (AUTO, EXPLICIT)),
    (
        "logical-to-size1",
        (1, None),
        ("embed", "mlp"),
        (("embed", "data"), ("mlp", None)),
        (AUTO, EXPLICIT),
    ),
    (
        "logical-to-none",
        (2, None),
        ("embed", "mlp"),
        (("embed", None), ("mlp", None)),
        (AUTO, EXPLICIT),
    ),
    ("logical-to-data", (2, None), ("embed", "mlp"), (("embed", None), ("mlp", "data")), (AUTO,)),
    ("data-of-two", (2, None), ("data", None), None, (AUTO,)),
    # Names the mesh lacks (annotations written for another mesh): replicated, as
    # nnx.jit ignores them.
    ("absent-names", (2, None), ("fsdp", "tp"), None, (AUTO, EXPLICIT)),
    ("absent-logical-names", (1, None), ("embed", "mlp"), None, (AUTO, EXPLICIT)),
]
# Known: on Auto axes, XLA lays out the cotangent of a stage whose kernel is sharded
# over the batch axis otherwise than the ahead-of-time guess (`precompile._Guess`),
# so the first call compiles that reader once more (calls 2.. compile nothing).
FIRST_CALL_FALLBACK = {("size1-model-in-a-tuple", AUTO), ("data-of-two", AUTO)}


def _annotation_cases():
    for name, mesh_shape, out_sharding, rules, kinds in ANNOTATIONS:
        for kind in kinds:
            marks = [pytest.mark.fallback_compiles] if (name, kind) in FIRST_CALL_FALLBACK else []
            yield pytest.param(
                mesh_shape, out_sharding, rules, kind, marks=marks, id=f"{name}-{kind.name.lower()}"
            )


@pytest.mark.parametrize("donate", [True, False], ids=["donate", "keep"])
@pytest.mark.parametrize("mesh_shape,out_sharding,rules,kind", list(_annotation_cases()))
def test_annotated_state_returns_as_it_came(mesh_shape, out_sharding, rules, kind, donate):
    data, model_axis = mesh_shape
    model = Annotated(out_sharding, rules, rngs=nnx.Rngs(0))
    twin = Annotated(out_sharding, rules, rngs=nnx.Rngs(0))
    mp.assign_stages(model, {"a": 0, "b": 1})
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    twin_opt = nnx.Optimizer(twin, optax.adam(1e-2), wrt=nnx.Param)
    step = mp.jit(
        _step,
        mesh=_mesh(2, data, kind, model_axis),
        schedule=mp.OneFOneB(),
        num_microbatches=2,
        donate_argnums=(0, 1) if donate else (),
    )
    _run_calls(step, nnx.jit(_step), (model, opt), (twin, twin_opt), CALLS)
    _assert_params_equal(model, twin)


@pytest.mark.parametrize(
    "out_sharding,kind,want",
    [
        (("data", None), AUTO, P()),
        ((None, ("data", "model")), AUTO, P(None, "data")),
        (("model", "data"), AUTO, P(None, "data")),
        (("data", None), EXPLICIT, P("data", None)),
        ((None, ("data", "model")), EXPLICIT, P(None, ("data", "model"))),
    ],
)
def test_placement_leaves_out_auto_axes_of_size_one(out_sharding, kind, want):
    from nnx_mpmd.placement.partition import leaf_sharding, placement_of

    data = 1 if out_sharding == ("data", None) else 2
    mesh = _mesh(2, data, kind, model=1)
    param = nnx.Param(
        jnp.zeros((4, 4)), mpmd_stage=1, out_sharding=out_sharding, eager_sharding=False
    )
    assert placement_of(param, "w", mesh) == ((1,), want)
    assert leaf_sharding(param, mesh.submesh(1)).spec == want


def test_axis_names_the_mesh_lacks_are_replicated_with_one_warning(monkeypatch):
    from nnx_mpmd.placement import partition

    monkeypatch.setattr(partition, "_WARNED_ABSENT", set())
    mesh = _mesh(2, 2)
    param = nnx.Param(
        jnp.zeros((4, 4)), mpmd_stage=1, out_sharding=("tp", "data"), eager_sharding=False
    )
    with pytest.warns(UserWarning, match=r"w: out_sharding .* names \['tp'\], which the submesh"):
        assert partition.placement_of(param, "w", mesh) == ((1,), P(None, "data"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per name
        assert partition.leaf_sharding(param, mesh.submesh(1)).spec == P(None, "data")


def test_logical_names_follow_flax_s_global_axis_rules(monkeypatch):
    """Rules set with ``flax.core.spmd.set_logical_axis_rules``, not in the metadata, apply too."""
    from flax.core import spmd

    from nnx_mpmd.placement import partition
    from nnx_mpmd.placement.partition import placement_of

    monkeypatch.setattr(partition, "_WARNED_ABSENT", set())

    mesh = _mesh(2, 2)
    param = nnx.Param(
        jnp.zeros((4, 4)), mpmd_stage=0, out_sharding=("embed", "mlp"), eager_sharding=False
    )
    before = spmd.get_logical_axis_rules()
    spmd.set_logical_axis_rules((("embed", None), ("mlp", "data")))
    try:
        assert placement_of(param, "w", mesh) == ((0,), P(None, "data"))
    finally:
        spmd.set_logical_axis_rules(before)
    with pytest.warns(UserWarning, match=r"names \['embed', 'mlp'\].*set_logical_axis_rules"):
        # no rules: names the mesh lacks are replicated, with a warning
        assert placement_of(param, "w", mesh) == ((0,), P())
