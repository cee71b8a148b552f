"""Small models and helpers shared by the pipeline tests (not a test module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from shared_results import once_per_test_run

import nnx_mpmd as mp
from nnx_mpmd.placement.mesh import MpmdMesh

WIDTH = 16
VOCAB = 32
SEQ = 8


class MLP(mp.PipelinedModel):
    """One Linear+tanh layer per stage."""

    def __init__(self, num_stages: int, *, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=s) for s in range(num_stages)]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def mlp_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn_q = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        # No key bias: its gradient is exactly zero in theory, so Adam would amplify
        # rounding noise into lr-sized updates and make comparisons meaningless.
        self.attn_k = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)
        self.attn_v = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.mlp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        h = self.norm(x)
        q, k, v = self.attn_q(h), self.attn_k(h), self.attn_v(h)
        scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(WIDTH)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        scores = jnp.where(mask, scores, -1e9)
        x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), v)
        return x + jax.nn.gelu(self.mlp(x))


class Head(nnx.Module):
    def __init__(self, embed: nnx.Embed | None, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.embed = embed
        self.out = None if embed is not None else nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, x):
        x = self.norm(x)
        return self.embed.attend(x) if self.embed is not None else self.out(x)


class TinyLM(mp.PipelinedModel):
    """Embedding on stage 0, one block per stage, head on the last stage."""

    def __init__(self, num_stages: int, *, tied: bool, rngs: nnx.Rngs) -> None:
        embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.embed = mp.Stage(embed, stage=0)
        self.pos = mp.Stage(nnx.Embed(SEQ, WIDTH, rngs=rngs), stage=0)
        self.blocks = nnx.List([mp.Stage(Block(rngs=rngs), stage=s) for s in range(num_stages)])
        self.head = mp.Stage(Head(embed if tied else None, rngs=rngs), stage=num_stages - 1)

    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[1])[None, :]  # glue: batch-only code
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


class GatedStage(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.value = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.gate = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, inputs):
        x, gate = inputs
        h = jnp.tanh(self.value(x)) * jax.nn.sigmoid(gate)
        return h, self.gate(h)


class GatedModel(mp.PipelinedModel):
    """Stages pass a pytree ``(x, gate)``; glue code runs between stages."""

    def __init__(self, num_stages: int, *, rngs: nnx.Rngs) -> None:
        self.stages = nnx.List(
            [mp.Stage(GatedStage(rngs=rngs), stage=s) for s in range(num_stages)]
        )

    def __call__(self, x):
        state = (x, jnp.zeros_like(x))
        for s in self.stages:
            x, gate = s(state)
            state = (x + 0.5 * state[0], gate * 0.9)  # glue between stages
        return state[0] * jnp.mean(state[1])


MODELS = {
    "mlp": (lambda s, rngs: MLP(s, rngs=rngs), mlp_loss, "regression"),
    "lm": (lambda s, rngs: TinyLM(s, tied=False, rngs=rngs), lm_loss, "tokens"),
    "lm_tied": (lambda s, rngs: TinyLM(s, tied=True, rngs=rngs), lm_loss, "tokens"),
    "gated": (lambda s, rngs: GatedModel(s, rngs=rngs), mlp_loss, "regression"),
}

# Adam divides by sqrt(v) + eps: with optax's eps=1e-8, a unit whose gradient is ~1e-8
# (a dead ReLU column of the LM) turns last-bit differences between two correct
# compilations of the same gradient (2e-8 here) into updates of up to +-lr, so the
# parameters after a few steps match only by chance. eps=1e-5 keeps an update's
# error about lr * (gradient error) / eps, well inside the comparisons' atol, while a
# wrong gradient (off by more than rounding) still moves the parameters far outside it.
ADAM_EPS = 1e-5

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.05),
    "adamw": lambda: optax.adamw(1e-2, eps=ADAM_EPS),
    "clip_adamw_cosine": lambda: optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), eps=ADAM_EPS),
    ),
}


def make_batch(kind: str, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "tokens":
        tokens = rng.integers(0, VOCAB, size=(batch_size, SEQ + 1)).astype(np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return {
        "x": rng.normal(size=(batch_size, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(batch_size, WIDTH)).astype(np.float32),
    }


def make_mesh(num_meshes: int, data: int, axis_types=None) -> MpmdMesh:
    devices = jax.devices()[: num_meshes * data]
    kwargs = {} if axis_types is None else {"axis_types": (axis_types,) * 2}
    return MpmdMesh(
        jax.make_mesh((num_meshes, data), ("stage", "data"), devices=devices, **kwargs), "stage"
    )


def train_step_fn(loss_fn, num_microbatches=None):
    def step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(loss_fn, num_microbatches=num_microbatches)(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def build(model_name: str, opt_name: str, num_stages: int, seed: int = 0):
    make_model, loss_fn, kind = MODELS[model_name]
    model = make_model(num_stages, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, OPTIMIZERS[opt_name](), wrt=nnx.Param)
    return model, optimizer, loss_fn, kind


def lm_on_four_meshes(opt_name: str, axis_types=None, num_microbatches: int = 4):
    """The 4-stage LM under 1F1B on 4 meshes x 2 data, and a twin model for the reference.

    Returns:
      ``(step, (model, optimizer), (reference model, optimizer), loss_fn, kind)``.
    """
    model, opt, loss_fn, kind = build("lm", opt_name, 4)
    ref_model, ref_opt, _, _ = build("lm", opt_name, 4)
    step = mp.jit(
        train_step_fn(loss_fn),
        mesh=make_mesh(4, 2, axis_types),
        schedule=mp.OneFOneB(),
        num_microbatches=num_microbatches,
    )
    return step, (model, opt), (ref_model, ref_opt), loss_fn, kind


def reference_run(
    model_name: str,
    opt_name: str,
    num_stages: int,
    num_microbatches: int,
    batch_size: int,
    steps: int,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """The ``nnx.jit`` reference of `build`'s model: per-step losses and final parameters.

    Steps ``make_batch(kind, batch_size, seed=s)`` for ``s < steps`` with
    `train_step_fn` over ``num_microbatches``. Several tests (of several files)
    compare their pipelined runs with the same reference: it is computed once
    per test run (`once_per_test_run`), not traced and compiled by each.

    Returns:
      ``(losses, params)``: a float per step and `params_of` the trained model.
    """
    key = (
        f"reference-{model_name}-{opt_name}-S{num_stages}-m{num_microbatches}"
        f"-b{batch_size}-n{steps}"
    )

    def compute(_directory) -> tuple[list[float], dict[str, np.ndarray]]:
        model, optimizer, loss_fn, kind = build(model_name, opt_name, num_stages)
        step = nnx.jit(train_step_fn(loss_fn, num_microbatches))
        losses = [
            float(step(model, optimizer, make_batch(kind, batch_size, seed=s)))
            for s in range(steps)
        ]
        return losses, params_of(model)

    return once_per_test_run(key, compute)


def params_of(model) -> dict[str, np.ndarray]:
    """Every Param by logical path, as NumPy arrays."""
    logical = mp.annotate.logical_paths(model) if hasattr(mp, "annotate") else None
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = ".".join(map(str, logical.get(tuple(path), path) if logical else path))
        out[key] = np.asarray(var.get_value())
    return out
