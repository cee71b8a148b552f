"""has_aux, remat, and other region features against the nnx.jit reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from pipeline_models import (
    MLP,
    WIDTH,
    build,
    make_batch,
    make_mesh,
    mlp_loss,
    params_of,
    train_step_fn,
)

import nnx_mpmd as mp


def _aux_loss(model, batch):
    logits = model(batch["inputs"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["targets"])
    return loss, {"accuracy": accuracy, "tokens": jnp.sum(batch["targets"] >= 0)}


def _aux_step(num_microbatches=None):
    def step(model, opt, batch):
        (loss, aux), grads = mp.value_and_grad(
            _aux_loss, has_aux=True, num_microbatches=num_microbatches
        )(model, batch)
        opt.update(model, grads)
        return loss, aux

    return step


@pytest.mark.parametrize("schedule", [mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["1f1b", "zb-h1"])
def test_has_aux_is_averaged_over_microbatches(schedule):
    ref_model, ref_opt, _, kind = build("lm", "adamw", 2)
    model, opt, _, _ = build("lm", "adamw", 2)
    reference = nnx.jit(_aux_step(4))
    pipelined = mp.jit(_aux_step(), mesh=make_mesh(2, 1), schedule=schedule, num_microbatches=4)
    for step in range(2):
        batch = make_batch(kind, 8, seed=step)
        ref_loss, ref_aux = reference(ref_model, ref_opt, batch)
        loss, aux = pipelined(model, opt, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        np.testing.assert_allclose(aux["accuracy"], ref_aux["accuracy"], rtol=1e-5)
        np.testing.assert_allclose(aux["tokens"], ref_aux["tokens"], rtol=1e-6)
        assert float(aux["tokens"]) == 8 * 8 / 4  # mean per microbatch: 2 rows x 8 tokens


class RematMLP(mp.PipelinedModel):
    def __init__(self, num_stages, remat, *, rngs):
        self.layers = nnx.List(
            [
                mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=s, remat=remat)
                for s in range(num_stages)
            ]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.sin(jnp.tanh(layer(x)) * 2.0)
        return x


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def forward_output_bytes(step, args, program="F0"):
    """Bytes the forward program ``program`` outputs (its sends and the residuals it keeps).

    Read from XLA's memory analysis of the compiled program, so it does not
    depend on how the runtime calls it.
    """
    analysis = step.lower(*args).compile().memory_analysis()[program]
    return analysis.output_size_in_bytes


@pytest.mark.parametrize("schedule", [mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["1f1b", "zb-h1"])
def test_remat_keeps_numerics_and_shrinks_residuals(schedule):
    results, kept = {}, {}
    for remat in (False, True):
        model = RematMLP(2, remat, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

        def step(model, opt, batch):
            loss, grads = mp.value_and_grad(_mse)(model, batch)
            opt.update(model, grads)
            return loss

        def build_step():
            return mp.jit(step, mesh=make_mesh(2, 1), schedule=schedule, num_microbatches=4)

        f = build_step()
        losses = [float(f(model, opt, make_batch("regression", 8, seed=s))) for s in range(2)]
        results[remat] = (losses, params_of(model))
        kept[remat] = forward_output_bytes(f, (model, opt, make_batch("regression", 8)))
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=1e-6)
    for path in results[False][1]:
        np.testing.assert_allclose(results[True][1][path], results[False][1][path], atol=1e-6)
    assert kept[True] < kept[False]


@pytest.mark.parametrize(
    "model_name,schedule,meshes,stages",
    [
        ("lm_tied", mp.OneFOneB(), 4, 4),
        ("mlp", mp.Interleaved1F1B(), 2, 4),
        ("lm", mp.GPipe(), 2, 2),
    ],
    ids=["lm_tied-1f1b", "mlp-interleaved", "lm-gpipe"],
)
def test_pipelined_inference_equals_nnx_jit(model_name, schedule, meshes, stages):
    model, _, _, kind = build(model_name, "sgd", stages)
    batch = make_batch(kind, 16)
    x = batch["inputs"] if kind == "tokens" else batch["x"]
    expected = nnx.jit(lambda m, x: m(x))(model, x)
    f = mp.jit(lambda m, x: m(x), mesh=make_mesh(meshes, 1), schedule=schedule, num_microbatches=4)
    got = f(model, x)
    assert got.shape == expected.shape  # microbatch outputs concatenated in order
    np.testing.assert_allclose(got, expected, atol=1e-6)
    # Only forward tasks run, and nothing recompiles on the next call.
    labels = [line for line in f.lower(model, x).instructions() if " run " in line]
    assert labels and not any(" run B" in line or " run FB" in line for line in labels)
    assert f.num_compiled_steps == 1


def test_pipelined_inference_returns_pytrees():
    model, _, _, kind = build("mlp", "sgd", 2)
    x = make_batch(kind, 8)["x"]
    f = mp.jit(
        lambda m, x: {"y": m(x), "norm": jnp.sum(m(x) ** 2, axis=-1)},
        mesh=make_mesh(2, 1),
        schedule=mp.GPipe(),
        num_microbatches=2,
    )
    expected = model(x)  # before mp.jit places the model on its submeshes
    out = f(model, x)
    np.testing.assert_allclose(out["y"], expected, atol=1e-6)
    np.testing.assert_allclose(out["norm"], jnp.sum(expected**2, axis=-1), atol=1e-5)


class LoraMLP(mp.PipelinedModel):
    """One LoRA-adapted Linear+tanh per stage (LoRAParam subclasses Param)."""

    def __init__(self, num_stages, *, rngs):
        self.layers = nnx.List(
            [
                mp.Stage(nnx.LoRALinear(WIDTH, WIDTH, lora_rank=2, rngs=rngs), stage=s)
                for s in range(num_stages)
            ]
        )
        for layer in self.layers:  # LoRA's B starts at zero: make A's gradient nonzero too
            layer.lora.lora_b[...] = jnp.full((2, WIDTH), 0.1, jnp.float32)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def _plain_nnx_step(wrt, num_microbatches):
    """The step in plain NNX: a loop over microbatches, the mean loss and gradient."""

    def step(model, opt, batch):
        grad_fn = nnx.value_and_grad(_mse, argnums=nnx.DiffState(0, wrt))
        size = batch["x"].shape[0] // num_microbatches
        results = [
            grad_fn(model, {k: v[i * size : (i + 1) * size] for k, v in batch.items()})
            for i in range(num_microbatches)
        ]
        loss = sum(r[0] for r in results) / num_microbatches
        grads = jax.tree.map(lambda *g: sum(g) / num_microbatches, *[r[1] for r in results])
        opt.update(model, grads)
        return loss

    return step


WRT_FILTERS = {
    "lora": nnx.LoRAParam,
    "bias_only": nnx.All(nnx.Param, nnx.PathContains("bias")),
}


def _filtered_grad_fn(given, wrt):
    """``mp.value_and_grad(_mse)`` differentiating ``wrt``, the filter given as ``given`` says."""
    if given == "wrt":
        return mp.value_and_grad(_mse, wrt=wrt)
    if given == "argnums":  # the NNX spelling
        return mp.value_and_grad(_mse, argnums=nnx.DiffState(0, wrt))

    @mp.value_and_grad(argnums=nnx.DiffState(0, wrt))
    def decorated(model, batch):
        return _mse(model, batch)

    return decorated


@pytest.mark.parametrize(
    ("wrt_name", "schedule", "given"),
    [
        ("lora", mp.OneFOneB(), "wrt"),
        ("lora", mp.ZeroBubbleH1(), "argnums"),
        ("bias_only", mp.OneFOneB(), "decorator"),
        ("bias_only", mp.ZeroBubbleH1(), "wrt"),
    ],
    ids=["lora-1f1b-wrt", "lora-zb-h1-argnums", "bias-1f1b-decorator", "bias-zb-h1-wrt"],
)
def test_training_a_filtered_subset_equals_plain_nnx(wrt_name, schedule, given):
    """``wrt`` (or NNX's ``argnums=nnx.DiffState(0, filter)``, also as a decorator) picks the
    trained Variables (LoRA fine-tuning, biases only); the rest stay bit-for-bit frozen and
    the trained ones follow plain NNX."""
    wrt = WRT_FILTERS[wrt_name]

    def build_lora():
        model = LoraMLP(4, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=wrt)

    def step(model, opt, batch):
        loss, grads = _filtered_grad_fn(given, wrt)(model, batch)
        opt.update(model, grads)
        return loss

    (ref_model, ref_opt), (model, opt) = build_lora(), build_lora()
    frozen = {k: v for k, v in params_of(model).items() if not _trained(wrt_name, k)}
    reference = nnx.jit(_plain_nnx_step(wrt, 4))
    pipelined = mp.jit(step, mesh=make_mesh(4, 2), schedule=schedule, num_microbatches=4)
    for i in range(3):
        batch = make_batch("regression", 16, seed=i)
        np.testing.assert_allclose(
            float(pipelined(model, opt, batch)), float(reference(ref_model, ref_opt, batch)),
            rtol=1e-5,
        )  # fmt: skip
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-6, err_msg=path)
        if path in frozen:
            np.testing.assert_array_equal(got[path], frozen[path], err_msg=path)
    assert 0 < len(frozen) < len(expected)
    assert pipelined.num_compiled_steps == 1


def _weighted_mse(model, x, y, weight=None):
    """A loss with its batch as several arguments, the way NNX code often writes it."""
    error = jnp.mean((model(x) - y) ** 2, axis=-1)
    return jnp.mean(error if weight is None else weight * error)


@pytest.mark.parametrize(
    ("schedule", "form"),
    [(mp.OneFOneB(), "positional"), (mp.ZeroBubbleH1(), "keywords")],
    ids=["1f1b-positional", "zb-h1-keywords"],
)
def test_a_loss_taking_several_batch_arguments_equals_nnx_jit(schedule, form):
    """``mp.value_and_grad(loss)(model, x, y)``, or with keyword arguments, splits each
    argument into the microbatches like one batch pytree; the numbers follow
    ``nnx.value_and_grad(loss)(model, x, y)`` on the full batch."""

    def step(model, opt, x, y, weight):
        grad_fn = mp.value_and_grad(_weighted_mse)
        if form == "positional":
            loss, grads = grad_fn(model, x, y, weight)
        else:
            loss, grads = grad_fn(model, x, weight=weight, y=y)
        opt.update(model, grads)
        return loss

    def reference_step(model, opt, x, y, weight):
        loss, grads = nnx.value_and_grad(_weighted_mse)(model, x, y, weight)
        opt.update(model, grads)
        return loss

    (model, opt, _, _), (ref_model, ref_opt, _, _) = (
        build("mlp", "adamw", 4),
        build("mlp", "adamw", 4),
    )
    pipelined = mp.jit(step, mesh=make_mesh(4, 2), schedule=schedule, num_microbatches=4)
    reference = nnx.jit(reference_step)
    for i in range(2):
        batch = make_batch("regression", 16, seed=i)
        weight = np.linspace(0.5, 1.5, 16, dtype=np.float32)
        np.testing.assert_allclose(
            float(pipelined(model, opt, batch["x"], batch["y"], weight)),
            float(reference(ref_model, ref_opt, batch["x"], batch["y"], weight)),
            rtol=1e-5,
        )
    expected, got = params_of(ref_model), params_of(model)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], atol=1e-5, err_msg=path)
    assert pipelined.num_compiled_steps == 1


def _trained(wrt_name, path):
    return "lora" in path if wrt_name == "lora" else path.endswith("bias")


def test_calling_a_trained_model_outside_mp_jit_names_mp_gather():
    """After a step each stage's state is on its own submesh: an eager call says to gather."""
    model, opt, loss_fn, kind = build("mlp", "sgd", 2)
    reference, ref_opt, _, _ = build("mlp", "sgd", 2)
    step = mp.jit(
        train_step_fn(loss_fn), mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2
    )
    batch = make_batch(kind, 8)
    step(model, opt, batch)
    nnx.jit(train_step_fn(loss_fn, num_microbatches=2))(reference, ref_opt, batch)
    with pytest.raises(
        mp.PlacementError,
        match=r"Stage 1 \(Linear\) was called outside mp.jit on arrays that live on different "
        r"devices.*mp\.gather\(model\).*JAX said: Received incompatible devices",
    ):
        loss_fn(model, batch)
    mp.gather(model)
    np.testing.assert_allclose(
        float(loss_fn(model, batch)), float(loss_fn(reference, batch)), rtol=1e-6
    )
    # The next step places the gathered state again.
    np.testing.assert_allclose(
        float(step(model, opt, make_batch(kind, 8, seed=1))),
        float(
            nnx.jit(train_step_fn(loss_fn, num_microbatches=2))(
                reference, ref_opt, make_batch(kind, 8, seed=1)
            )
        ),
        rtol=1e-6,
    )


class ReusedBlock(mp.PipelinedModel):
    """One Linear run at every pipeline position (ALBERT-style weight sharing)."""

    def __init__(self, num_stages: int, rngs: nnx.Rngs) -> None:
        block = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.positions = nnx.List([mp.Stage(block, stage=s) for s in range(num_stages)])

    def __call__(self, x):
        for position in self.positions:
            x = jnp.tanh(position(x))
        return x


@pytest.mark.parametrize(
    ("schedule", "num_stages", "num_meshes"),
    [(mp.OneFOneB(), 3, 3), (mp.ZeroBubbleH1(), 3, 3), (mp.Interleaved1F1B(), 4, 2)],
    ids=["1f1b", "zb-h1", "interleaved"],
)
def test_one_module_at_every_position_shares_its_weights_like_nnx_jit(
    schedule, num_stages, num_meshes
):
    models = [ReusedBlock(num_stages, nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models]
    reference = nnx.jit(train_step_fn(mlp_loss, num_microbatches=4))
    step = mp.jit(
        train_step_fn(mlp_loss),
        mesh=make_mesh(num_meshes, 2),
        schedule=schedule,
        num_microbatches=4,
    )
    for i in range(3):
        batch = make_batch("mlp", 16, i)
        np.testing.assert_allclose(
            float(step(models[0], optimizers[0], batch)),
            float(reference(models[1], optimizers[1], batch)),
            rtol=1e-6,
        )
    got, want = params_of(models[0]), params_of(models[1])
    assert list(got) == ["positions.0.bias", "positions.0.kernel"]
    for path in got:
        np.testing.assert_allclose(got[path], want[path], atol=1e-6, err_msg=path)
    kernel = models[0].positions[0].module.kernel
    assert kernel.get_metadata()["mpmd_stages"] == tuple(range(num_stages))


def _two_views_loss(model, batch):
    """A contrastive-style loss: the same pipelined model on two inputs."""
    z1, z2 = model(batch["x"]), model(batch["y"])
    return jnp.mean((z1 - z2) ** 2) + 0.1 * jnp.mean(z1**2)


def _distillation_step(num_microbatches=None):
    def step(student, teacher, optimizer, batch):
        def loss_fn(model, b):
            target = jax.lax.stop_gradient(teacher(b["x"]))  # a second pipelined model
            return jnp.mean((model(b["x"]) - target) ** 2)

        loss, grads = mp.value_and_grad(loss_fn, num_microbatches=num_microbatches)(student, batch)
        optimizer.update(student, grads)
        return loss

    return step


@pytest.mark.parametrize("schedule", [mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["1f1b", "zb-h1"])
@pytest.mark.parametrize("case", ["two-views", "teacher-student"])
def test_stages_called_twice_in_order_in_one_loss_equal_nnx_jit(case, schedule):
    """Each stage runs both calls in its task: model(x1) and model(x2), or a teacher's
    stages and a student's."""
    models = [MLP(2, rngs=nnx.Rngs(0)) for _ in range(2)]
    optimizers = [nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models]
    mesh = make_mesh(2, 2)
    if case == "two-views":
        step = mp.jit(
            train_step_fn(_two_views_loss), mesh=mesh, schedule=schedule, num_microbatches=4
        )
        reference = nnx.jit(train_step_fn(_two_views_loss, num_microbatches=4))
        extra = [(), ()]
    else:
        step = mp.jit(_distillation_step(), mesh=mesh, schedule=schedule, num_microbatches=4)
        reference = nnx.jit(_distillation_step(4))
        extra = [(MLP(2, rngs=nnx.Rngs(7)),), (MLP(2, rngs=nnx.Rngs(7)),)]
    for i in range(2):
        batch = make_batch("mlp", 16, i)
        np.testing.assert_allclose(
            float(step(models[0], *extra[0], optimizers[0], batch)),
            float(reference(models[1], *extra[1], optimizers[1], batch)),
            rtol=1e-6,
        )
    got, want = params_of(models[0]), params_of(models[1])
    for path in got:
        np.testing.assert_allclose(got[path], want[path], atol=1e-6, err_msg=path)
