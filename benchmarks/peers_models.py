"""The workloads of `make bench-peers`, in plain JAX + NumPy.

Every peer (nnx_mpmd, JaxPP, the hand-written floor and the one-device jit)
builds its step from these functions, so all of them compute the same loss on
the same parameters and batches. Nothing here imports Flax or nnx_mpmd: JaxPP's
worker imports this module under its own venv (jax 0.9.2).

A model is ``{"embed": ..., "layers": [...], "head": ...}`` (``embed`` and
``head`` are empty for the MLP). Logical stage ``s`` of ``n`` holds layers
``[s * L / n, (s + 1) * L / n)``, plus the embedding on stage 0 and the head on
the last stage. Each microbatch's loss is its mean; a step's loss is the mean
over microbatches (nnx_mpmd's ``reduction="mean"``).

Example:
    >>> row = ROWS["overhead"]
    >>> params = init_params(row)
    >>> len(params["layers"]), list(row.stage_layers(1))
    (8, [2, 3])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: Learning rate of the plain SGD update every peer applies.
LEARNING_RATE = 1e-2


@dataclasses.dataclass(frozen=True)
class Row:
    """One benchmark row: model, pipeline shape and schedule.

    Args:
      name: the row's key in `ROWS`.
      kind: ``"mlp"`` (residual tanh MLP, MSE loss) or ``"gpt"`` (pre-norm
        transformer, next-token cross entropy).
      layers: residual blocks.
      width: model width.
      microbatches: microbatches per step.
      microbatch_size: rows per microbatch.
      meshes: pipeline submeshes (the stage axis).
      data: devices per submesh (the data axis).
      virtual: stages per mesh (2 = interleaved 1F1B).
      seq, vocab, heads: the transformer's sequence length, vocabulary and heads.
      note: a one-line description for the table.
    """

    name: str
    kind: str
    layers: int
    width: int
    microbatches: int
    microbatch_size: int
    meshes: int = 4
    data: int = 1
    virtual: int = 1
    seq: int = 0
    vocab: int = 0
    heads: int = 0
    note: str = ""

    @property
    def num_stages(self) -> int:
        """Logical stages: meshes × virtual stages."""
        return self.meshes * self.virtual

    @property
    def devices(self) -> int:
        """Devices the pipelined peers use."""
        return self.meshes * self.data

    def stage_layers(self, stage: int) -> range:
        """The layer indices of logical stage ``stage``."""
        per = self.layers // self.num_stages
        return range(stage * per, (stage + 1) * per)

    def mesh_of(self, stage: int) -> int:
        """The mesh of logical stage ``stage`` (looped placement, as interleaved 1F1B)."""
        return stage % self.meshes


ROWS: dict[str, Row] = {
    row.name: row
    for row in (
        Row("compute", "mlp", 8, 1024, 8, 64, note="compute-bound MLP 8×1024, 4 meshes, m=8×64"),
        Row("overhead", "mlp", 8, 64, 16, 8, note="overhead-bound MLP 8×64, 4 meshes, m=16×8"),
        Row(
            "interleaved",
            "mlp",
            8,
            256,
            8,
            32,
            virtual=2,
            note="MLP 8×256, 4 meshes × 2 virtual stages, m=8×32",
        ),
        Row("dp", "mlp", 8, 512, 8, 64, data=2, note="MLP 8×512, 4 meshes × 2 data, m=8×64"),
        Row(
            "gpt",
            "gpt",
            4,
            128,
            8,
            8,
            seq=64,
            vocab=512,
            heads=4,
            note="GPT 4 blocks d=128 T=64 V=512, 4 meshes, m=8×8",
        ),
        Row(
            "tiny",
            "mlp",
            4,
            8,
            4,
            2,
            meshes=2,
            data=2,
            virtual=2,
            note="test row: MLP 4×8, 2 meshes × 2 data × 2 virtual stages",
        ),
        Row(
            "tiny-gpt",
            "gpt",
            2,
            16,
            2,
            2,
            meshes=2,
            seq=8,
            vocab=32,
            heads=2,
            note="test row: GPT 2 blocks d=16, 2 meshes",
        ),
    )
}


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def init_params(row: Row, seed: int = 0) -> dict[str, Any]:
    """NumPy parameters of ``row``'s model, equal in every venv for one seed."""
    rng = np.random.default_rng(seed)
    d = row.width
    if row.kind == "mlp":
        layers = [
            {"w": _normal(rng, (d, d), d**-0.5), "b": np.zeros((d,), np.float32)}
            for _ in range(row.layers)
        ]
        return {"embed": {}, "layers": layers, "head": {}}
    ones, zeros = np.ones((d,), np.float32), np.zeros((d,), np.float32)
    layers = [
        {
            "ln1": ones.copy(),
            "qkv": _normal(rng, (d, 3 * d), d**-0.5),
            "out": _normal(rng, (d, d), d**-0.5),
            "ln2": ones.copy(),
            "up": _normal(rng, (d, 4 * d), d**-0.5),
            "down": _normal(rng, (4 * d, d), (4 * d) ** -0.5),
        }
        for _ in range(row.layers)
    ]
    embed = {"tok": _normal(rng, (row.vocab, d), 0.02), "pos": _normal(rng, (row.seq, d), 0.02)}
    head = {"ln": ones, "bias": zeros, "out": _normal(rng, (d, row.vocab), d**-0.5)}
    return {"embed": embed, "layers": layers, "head": head}


def make_batch(row: Row, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)`` of one step, shaped ``(microbatches, microbatch_size, ...)``."""
    rng = np.random.default_rng(seed)
    lead = (row.microbatches, row.microbatch_size)
    if row.kind == "mlp":
        x = rng.standard_normal((*lead, row.width)).astype(np.float32)
        y = rng.standard_normal((*lead, row.width)).astype(np.float32)
        return x, y
    tokens = rng.integers(0, row.vocab, (*lead, row.seq + 1)).astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


def _layer_norm(x: jax.Array, gain: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * gain


def _attention(p: dict, x: jax.Array, heads: int) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, -1e9)
    mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
    return mixed.reshape(b, t, d) @ p["out"]


def layer_forward(row: Row, p: dict, h: jax.Array) -> jax.Array:
    """One residual block of ``row``'s model."""
    if row.kind == "mlp":
        return jnp.tanh(h @ p["w"] + p["b"]) + h
    h = h + _attention(p, _layer_norm(h, p["ln1"]), row.heads)
    return h + jax.nn.gelu(_layer_norm(h, p["ln2"]) @ p["up"]) @ p["down"]


def embed_forward(row: Row, embed: dict, x: jax.Array) -> jax.Array:
    """The first stage's input: tokens embedded (GPT) or the inputs (MLP)."""
    if row.kind == "mlp":
        return x
    return embed["tok"][x] + embed["pos"][None, : x.shape[1]]


def head_forward(row: Row, head: dict, h: jax.Array) -> jax.Array:
    """The last stage's output: logits (GPT) or the hidden state (MLP)."""
    if row.kind == "mlp":
        return h
    return (_layer_norm(h, head["ln"]) + head["bias"]) @ head["out"]


def output_loss(row: Row, out: jax.Array, y: jax.Array) -> jax.Array:
    """One microbatch's mean loss from the last stage's output."""
    if row.kind == "mlp":
        return jnp.mean((out - y) ** 2)
    logp = jax.nn.log_softmax(out, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def stage_params(row: Row, params: dict, stage: int) -> dict:
    """The part of ``params`` that logical stage ``stage`` owns."""
    last = stage == row.num_stages - 1
    return {
        "embed": params["embed"] if stage == 0 else {},
        "layers": [params["layers"][i] for i in row.stage_layers(stage)],
        "head": params["head"] if last else {},
    }


def merge_stage_params(row: Row, parts: list[dict]) -> dict:
    """The inverse of `stage_params` over all stages."""
    return {
        "embed": parts[0]["embed"],
        "layers": [layer for part in parts for layer in part["layers"]],
        "head": parts[-1]["head"],
    }


def stage_forward(row: Row, stage: int, sp: dict, h: jax.Array) -> jax.Array:
    """Logical stage ``stage``'s forward: embedding, its layers, head."""
    if stage == 0:
        h = embed_forward(row, sp["embed"], h)
    for p in sp["layers"]:
        h = layer_forward(row, p, h)
    if stage == row.num_stages - 1:
        h = head_forward(row, sp["head"], h)
    return h


def microbatch_loss(row: Row, params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    """One microbatch's mean loss through every stage (the unpipelined model)."""
    h = x
    for s in range(row.num_stages):
        h = stage_forward(row, s, stage_params(row, params, s), h)
    return output_loss(row, h, y)


def sgd(params: Any, grads: Any) -> Any:
    """The update every peer applies."""
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def one_device_step(row: Row):
    """The microbatched step under one ``jax.jit``: the denominator of every ratio.

    Returns:
      ``step(params, xs, ys) -> (params, loss)``, jitted, params donated.
    """

    def step(params, xs, ys):
        def body(carry, batch):
            loss, grads = jax.value_and_grad(functools.partial(microbatch_loss, row))(
                params, *batch
            )
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), params))
        (loss, grads), _ = jax.lax.scan(body, zeros, (xs, ys))
        m = row.microbatches
        grads = jax.tree.map(lambda g: g / m, grads)
        return sgd(params, grads), loss / m

    return jax.jit(step, donate_argnums=0)


def time_steps(run_step, block, steps: int, warmup: int) -> dict[str, Any]:
    """Times a step: the first call (cold: compiles), ``warmup`` untimed, ``steps`` timed.

    Args:
      run_step: ``() -> loss``; runs one step (updating its own state).
      block: ``(loss) -> float``; waits until the step and its state are done.
      steps: timed steps.
      warmup: untimed steps after the first.

    Returns:
      ``{"first_step_s", "step_s", "median_s", "losses"}`` (losses of every step).
    """
    import statistics
    import time

    start = time.perf_counter()
    losses = [block(run_step())]
    first = time.perf_counter() - start
    times = []
    for n in range(warmup + steps):
        start = time.perf_counter()
        losses.append(block(run_step()))
        if n >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "first_step_s": first,
        "step_s": times,
        "median_s": statistics.median(times) if times else float("nan"),
        "losses": losses,
    }


def setup_cpu_devices(count: int = 8) -> None:
    """Asks for ``count`` simulated CPU devices and no persistent compilation cache."""
    jax.config.update("jax_num_cpu_devices", count)
    if jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", None)
