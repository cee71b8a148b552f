"""A ScanStack (layers stacked and run with nnx.scan) split across stages by ranges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from pipeline_models import WIDTH, make_batch, make_mesh
from shared_results import once_per_test_run

import nnx_mpmd as mp
from nnx_mpmd.annotate.scan_stack import split_scan_stacks
from nnx_mpmd.models import build_model, lm_loss

NUM_LAYERS = 8


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.mlp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.mlp(self.norm(x)))


class StackedNet(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = mp.Stage(nnx.Linear(WIDTH, WIDTH, rngs=rngs), stage=0)
        self.blocks = mp.ScanStack(Block, NUM_LAYERS, rngs=rngs)
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.head(self.blocks(self.embed(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def train_step(num_microbatches=None):
    def step(model, optimizer, batch):
        loss, grads = mp.value_and_grad(loss_fn, num_microbatches=num_microbatches)(model, batch)
        optimizer.update(model, grads)
        return loss

    return step


def _assert_losses_equal(step, ref_step, pipelined, reference, batches):
    """Runs ``step`` on ``pipelined`` and ``ref_step`` on ``reference`` (each a
    ``(model, optimizer)``) over ``batches``, comparing every loss."""
    for batch in batches:
        np.testing.assert_allclose(
            float(step(*pipelined, batch)), float(ref_step(*reference, batch)), rtol=1e-5
        )


# (schedule, meshes, {range pattern: stage}, head stage)
LAYOUTS = [
    (mp.OneFOneB(), 2, {"blocks[0:4]": 0, "blocks[4:8]": 1}, 1),
    (mp.GPipe(), 2, {"blocks[:3]": 0, "blocks[3:]": 1}, 1),
    (mp.OneFOneB(), 4, {"blocks[0:2]": 0, "blocks[2:4]": 1, "blocks[4:6]": 2, "blocks[6:]": 3}, 3),
    (mp.Interleaved1F1B(), 2, {"blocks[0:2]": 0, "blocks[2:5]": 1, "blocks[5:7]": 2,
                               "blocks[7:8]": 3}, 3),
    (mp.ZeroBubbleH1(), 2, {"blocks[0:4]": 0, "blocks[4:8]": 1}, 1),
]  # fmt: skip


def _train_beside_reference(layout, checkpoint=None):
    """Three steps of ``layout`` beside the unsplit model under ``nnx.jit``: the losses, the
    chunks' stages and a probe's outputs after them; saved to ``checkpoint`` (if given)
    before the third step."""
    schedule, meshes, ranges, head = layout
    model, reference = StackedNet(nnx.Rngs(0)), StackedNet(nnx.Rngs(0))
    mp.assign_stages(model, {**ranges, "head": head})
    chunk_stages = [chunk.stage for chunk in model.blocks.chunks]
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)
    step = mp.jit(
        train_step(), mesh=make_mesh(meshes, 8 // meshes), schedule=schedule, num_microbatches=4
    )
    ref_step = nnx.jit(train_step(4))
    losses, ref_losses = [], []
    for seed in range(3):
        if seed == 2 and checkpoint is not None:
            mp.checkpoint.save(checkpoint, {"model": model, "optimizer": optimizer})
        batch = make_batch("regression", 16, seed=seed)
        losses.append(float(jax.device_get(step(model, optimizer, batch))))
        ref_losses.append(float(ref_step(reference, ref_optimizer, batch)))
    mp.gather(model)
    probe = make_batch("regression", 4, seed=9)["x"]
    return {
        "chunk_stages": chunk_stages,
        "losses": losses,
        "ref_losses": ref_losses,
        "outputs": np.asarray(model(probe)),
        "ref_outputs": np.asarray(reference(probe)),
        "checkpoint": checkpoint,
    }


def _first_layout_run():
    """`_train_beside_reference` of ``LAYOUTS[0]``, run once for the whole test run: its
    checkpoint after two steps is what the re-cut tests restore (one compile, not four)."""
    return once_per_test_run(
        "scan-stack-first-layout", lambda d: _train_beside_reference(LAYOUTS[0], d / "ckpt")
    )


@pytest.mark.parametrize(
    "layout", range(len(LAYOUTS)), ids=["1f1b-2", "gpipe-2", "1f1b-4", "inter-4", "zb-2"]
)
def test_split_stack_trains_like_the_unsplit_reference(layout):
    run = _first_layout_run() if layout == 0 else _train_beside_reference(LAYOUTS[layout])
    assert run["chunk_stages"] == sorted(set(LAYOUTS[layout][2].values()))
    for loss, ref_loss in zip(run["losses"], run["ref_losses"], strict=True):
        np.testing.assert_allclose(loss, ref_loss, 1e-5)
    np.testing.assert_allclose(run["outputs"], run["ref_outputs"], rtol=1e-5, atol=1e-6)


def test_split_slices_every_variable_and_can_split_again():
    stack = mp.ScanStack(Block, NUM_LAYERS, rngs=nnx.Rngs(0))
    x = jnp.ones((2, WIDTH))
    whole, kernel = stack(x), np.asarray(stack.chunks[0].layers.mlp.kernel.get_value())
    stack.split({(0, 3): 0, (3, 8): 1})
    assert [c.module.layers.mlp.kernel.shape[0] for c in stack.chunks] == [3, 5]
    np.testing.assert_array_equal(stack.chunks[1].module.layers.mlp.kernel.get_value(), kernel[3:])
    assert mp.annotate.variable_stage(stack.chunks[1].module.layers.mlp.kernel) == 1
    stack.split({(0, 6): 0, (6, 8): 2})  # re-cut: the chunks are joined first
    assert [(c.stage, c.module.num_layers) for c in stack.chunks] == [(0, 6), (2, 2)]
    assert mp.annotate.variable_stage(stack.chunks[0].module.layers.mlp.kernel) == 0
    np.testing.assert_allclose(stack(x), whole, rtol=1e-6)


def test_stage_summary_names_each_chunk_by_its_layer_range():
    stack = mp.ScanStack(Block, NUM_LAYERS, rngs=nnx.Rngs(0))
    stack.split({(0, 3): 0, (3, 8): 1})
    assert stack.chunk_ranges() == [(0, 3), (3, 8)]
    summary = mp.annotate.stage_summary(nnx.Dict(blocks=stack))
    lines = summary.splitlines()
    assert lines[1].startswith("0") and lines[1].endswith("blocks[0:3]"), summary
    assert lines[2].startswith("1") and lines[2].endswith("blocks[3:8]"), summary
    assert "chunks" not in summary


@pytest.mark.parametrize(
    "ranges,match",
    [
        ({"blocks[0:3]": 0, "blocks[4:8]": 1}, r"do not cut the stack's 8 layers.*at layer 3"),
        ({"blocks[0:5]": 0, "blocks[4:8]": 1}, r"consecutive non-empty pieces"),
        ({"blocks[0:4]": 0}, r"cover layers 0\.\.4 of 8; add \[4:8\]"),
        ({"blocks[0:4]": 0, "blocks[4:8]": -1}, r"maps to stage -1"),
        ({"embed[0:1]": 0}, r"'embed', which is not an mp.ScanStack \(the model's ScanStacks: blocks\)"),
    ],
)  # fmt: skip
def test_bad_ranges_are_errors(ranges, match):
    model = StackedNet(nnx.Rngs(0))
    with pytest.raises(mp.PartitionError, match=match):
        split_scan_stacks(model, ranges)


def test_scan_stack_needs_layers():
    with pytest.raises(mp.PartitionError, match=r"num_layers=0.*int >= 1"):
        mp.ScanStack(Block, 0, rngs=nnx.Rngs(0))


# (ranges, meshes, schedule, place the target before restoring)
RECUTS = [
    ({"blocks[:2]": 0, "blocks[2:]": 1, "head": 1}, 2, mp.OneFOneB(), True),
    ({"blocks[:3]": 0, "blocks[3:5]": 1, "blocks[5:7]": 2, "blocks[7:]": 3, "head": 3}, 4,
     mp.OneFOneB(), False),
    ({"blocks": 0, "head": 0}, 1, mp.GPipe(), True),
]  # fmt: skip


@pytest.mark.parametrize(
    "ranges,meshes,schedule,placed", RECUTS, ids=["2-other-ranges", "4-chunks", "unsplit"]
)
def test_a_checkpoint_restores_into_a_stack_cut_into_other_ranges(ranges, meshes, schedule, placed):
    """``LAYOUTS[0]``'s checkpoint after two steps (`_first_layout_run`) restored into a
    stack cut otherwise: its third step's loss and outputs are the unsplit reference's."""
    saved = _first_layout_run()
    model = mp.assign_stages(StackedNet(nnx.Rngs(1)), ranges)
    new_optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    mesh = make_mesh(meshes, 8 // meshes)
    if placed:
        mp.place((model, new_optimizer), mesh, schedule)
    mp.checkpoint.restore(saved["checkpoint"], {"model": model, "optimizer": new_optimizer})
    new_step = mp.jit(train_step(), mesh=mesh, schedule=schedule, num_microbatches=4)
    batch = make_batch("regression", 16, seed=2)
    np.testing.assert_allclose(
        float(new_step(model, new_optimizer, batch)), saved["ref_losses"][2], rtol=1e-5
    )
    mp.gather(model)
    probe = make_batch("regression", 4, seed=9)["x"]
    np.testing.assert_allclose(model(probe), saved["ref_outputs"], rtol=1e-5, atol=1e-6)


def test_a_stack_with_other_layers_in_total_is_still_a_shape_mismatch(tmp_path):
    saved = mp.assign_stages(StackedNet(nnx.Rngs(0)), {"blocks[:4]": 0, "blocks[4:]": 1})
    mp.checkpoint.save(tmp_path / "ckpt", {"model": saved})
    other = StackedNet(nnx.Rngs(0))
    other.blocks = mp.ScanStack(Block, NUM_LAYERS - 2, rngs=nnx.Rngs(0))
    mp.assign_stages(other, {"blocks[:3]": 0, "blocks[3:]": 1})
    with pytest.raises(mp.CheckpointError, match=r"shape mismatch at 'model\.blocks\.chunks\.0"):
        mp.checkpoint.restore(tmp_path / "ckpt", {"model": other})


class DroppingBlock(nnx.Module):
    """A layer with a dropout stream of its own: stacked, one key and count per layer."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.mlp = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.mlp(x)))


class DroppingNet(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = mp.ScanStack(DroppingBlock, NUM_LAYERS, rngs=rngs)
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.head(self.blocks(x))


def _counts(model):
    return [int(c) for _, v in nnx.to_flat_state(nnx.state(model, nnx.RngCount)) for c in v[...]]


# (schedule, ranges, meshes, axis types)
DROPPING = [
    (mp.OneFOneB(), {"blocks[:4]": 0, "blocks[4:]": 1, "head": 1}, 2, None),
    (mp.ZeroBubbleH1(), {"blocks[:3]": 0, "blocks[3:]": 1, "head": 1}, 2, AxisType.Auto),
    (mp.Interleaved1F1B(), {"blocks[:2]": 0, "blocks[2:4]": 1, "blocks[4:6]": 2,
                            "blocks[6:]": 3, "head": 3}, 2, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "schedule,ranges,meshes,axis_type", DROPPING, ids=["1f1b", "zb-h1-auto", "interleaved"]
)
def test_stacked_layers_with_dropout_streams_train_like_nnx_jit(
    schedule, ranges, meshes, axis_type
):
    model, reference = mp.assign_stages(DroppingNet(nnx.Rngs(0)), ranges), DroppingNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    step = mp.jit(
        train_step(),
        mesh=make_mesh(meshes, 8 // meshes, axis_type),
        schedule=schedule,
        num_microbatches=4,
    )
    ref_step = nnx.jit(train_step(4))
    batches = [make_batch("regression", 16, seed=seed) for seed in range(3)]
    _assert_losses_equal(step, ref_step, (model, optimizer), (reference, ref_optimizer), batches)
    assert _counts(model) == _counts(reference) == [3 * 4] * NUM_LAYERS  # steps x microbatches
    mp.gather(model)
    model.eval()
    reference.eval()
    probe = make_batch("regression", 4, seed=9)["x"]
    np.testing.assert_allclose(model(probe), reference(probe), rtol=1e-5, atol=1e-5)


def test_stacked_dropout_streams_restore_into_other_ranges(tmp_path):
    saved = mp.assign_stages(DroppingNet(nnx.Rngs(0)), DROPPING[0][1])
    optimizer = nnx.Optimizer(saved, optax.sgd(0.1), wrt=nnx.Param)
    step = mp.jit(train_step(), mesh=make_mesh(2, 4), schedule=mp.OneFOneB(), num_microbatches=4)
    step(saved, optimizer, make_batch("regression", 16, seed=0))
    mp.checkpoint.save(tmp_path / "ckpt", {"model": saved, "optimizer": optimizer})
    model = mp.assign_stages(DroppingNet(nnx.Rngs(1)), DROPPING[1][1])
    new_optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    mp.checkpoint.restore(tmp_path / "ckpt", {"model": model, "optimizer": new_optimizer})
    batch = make_batch("regression", 16, seed=1)
    np.testing.assert_allclose(  # the same keys are drawn: the same dropout masks
        float(step(saved, optimizer, batch)),
        float(
            mp.jit(
                train_step(), mesh=make_mesh(2, 4), schedule=mp.ZeroBubbleH1(), num_microbatches=4
            )(model, new_optimizer, batch)
        ),
        rtol=1e-5,
    )
    assert _counts(model) == _counts(saved) == [2 * 4] * NUM_LAYERS


SEQ_LEN = 6


class MaskedBlock(nnx.Module):
    """Self-attention that takes the padding mask and a keyword from the caller."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=WIDTH, qkv_features=WIDTH, decode=False, rngs=rngs
        )
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, x, mask, *, scale=1.0):
        return x + scale * self.attn(self.norm(x), mask=mask)


class MaskedNet(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.blocks = mp.ScanStack(MaskedBlock, 6, rngs=rngs)
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x, valid):
        mask = nnx.make_attention_mask(valid, valid) * nnx.make_causal_mask(valid)
        return self.head(self.blocks(self.embed(x), mask, scale=0.5))


def _masked_loss(model, batch):
    return jnp.mean((model(batch["x"], batch["valid"])[..., 0] - batch["y"]) ** 2)


def _padded_batch(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, SEQ_LEN + 1, size=(16, 1))
    return {
        "x": rng.normal(size=(16, SEQ_LEN, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(16, SEQ_LEN)).astype(np.float32),
        "valid": (np.arange(SEQ_LEN)[None] < lengths).astype(np.int32),
    }


@pytest.mark.parametrize("schedule", [mp.OneFOneB(), mp.ZeroBubbleH1()], ids=["1f1b", "zb-h1"])
def test_every_layer_gets_the_extra_arguments_of_the_stack(schedule):
    def step_fn(num_microbatches=None):
        def step(model, optimizer, batch):
            loss, grads = mp.value_and_grad(_masked_loss, num_microbatches=num_microbatches)(
                model, batch
            )
            optimizer.update(model, grads)
            return loss

        return step

    ranges = {"embed": 0, "blocks[:3]": 0, "blocks[3:]": 1, "head": 1}
    model, reference = mp.assign_stages(MaskedNet(nnx.Rngs(0)), ranges), MaskedNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)
    step = mp.jit(step_fn(), mesh=make_mesh(2, 2), schedule=schedule, num_microbatches=4)
    ref_step = nnx.jit(step_fn(4))
    batches = [_padded_batch(seed) for seed in range(3)]
    _assert_losses_equal(step, ref_step, (model, optimizer), (reference, ref_optimizer), batches)


class ShardedBlock(nnx.Module):
    """A layer whose kernel is sharded over the data axis on its output features."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        sharded = {"out_sharding": (None, "data"), "eager_sharding": False}
        self.mlp = nnx.Linear(WIDTH, WIDTH, kernel_metadata=sharded, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.mlp(x))


class ShardedNet(mp.PipelinedModel):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = mp.ScanStack(ShardedBlock, NUM_LAYERS, rngs=rngs)
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.head(self.blocks(x))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_stacked_variables_keep_their_sharding_behind_the_layer_axis(axis_type):
    ranges = {"blocks[:4]": 0, "blocks[4:]": 1, "head": 1}
    model, reference = mp.assign_stages(ShardedNet(nnx.Rngs(0)), ranges), ShardedNet(nnx.Rngs(0))
    kernel = model.blocks.chunks[0].module.layers.mlp.kernel
    assert kernel.get_metadata()["out_sharding"] == (None, None, "data")  # layers, in, out
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-2), wrt=nnx.Param)
    step = mp.jit(
        train_step(), mesh=make_mesh(2, 2, axis_type), schedule=mp.OneFOneB(), num_microbatches=4
    )
    ref_step = nnx.jit(train_step(4))
    batches = [make_batch("regression", 16, seed=seed) for seed in range(2)]
    _assert_losses_equal(step, ref_step, (model, optimizer), (reference, ref_optimizer), batches)
    spec = model.blocks.chunks[1].module.layers.mlp.kernel.get_value().sharding.spec
    assert tuple(spec) == (None, None, "data")


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_a_trained_stack_can_be_cut_again(axis_type):
    model = mp.assign_stages(StackedNet(nnx.Rngs(0)), {**LAYOUTS[0][2], "head": 1})
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    mesh = make_mesh(2, 2, axis_type)
    step = mp.jit(train_step(), mesh=mesh, schedule=mp.OneFOneB(), num_microbatches=4)
    step(model, optimizer, make_batch("regression", 16, seed=0))
    trained = mp.gather(nnx.clone(model))
    mp.assign_stages(model, {"blocks[:2]": 0, "blocks[2:]": 1})  # the chunks were placed
    assert model.blocks.chunk_ranges() == [(0, 2), (2, 8)]
    probe = make_batch("regression", 4, seed=9)["x"]
    np.testing.assert_allclose(mp.gather(nnx.clone(model))(probe), trained(probe), rtol=1e-6)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    assert np.isfinite(float(step(model, optimizer, make_batch("regression", 16, seed=1))))


def _zoo_gpt(scan_layers, num_stages, n_layers=4):
    model = build_model(
        "gpt", "tiny", num_stages=num_stages, rngs=nnx.Rngs(0), n_layers=n_layers,
        scan_layers=scan_layers,
    )  # fmt: skip
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def _zoo_step(model, optimizer, batch):
    loss, grads = mp.value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def _token_batches(count):
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 256, (8, 17)).astype(np.int32) for _ in range(count)]
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def test_a_checkpoint_converts_between_a_stack_and_its_unrolled_layers(tmp_path):
    """A zoo model's checkpoint restores into its twin built the other way (`scan_layers`),
    parameters and Adam's state, split into other stages: the next step's loss is the
    uninterrupted run's. Both ways: the stacked model on 2 meshes and the unrolled one on
    4 are each a saved run and the other's twin, run by the same two steps."""
    batches = _token_batches(3)
    meshes = {True: 2, False: 4}  # by scan_layers
    steps = {
        scanned: mp.jit(
            _zoo_step, mesh=make_mesh(m, 8 // m), schedule=mp.OneFOneB(), num_microbatches=4
        )
        for scanned, m in meshes.items()
    }
    for saved_scanned in (True, False):
        model, optimizer = _zoo_gpt(saved_scanned, meshes[saved_scanned])
        for batch in batches[:2]:
            steps[saved_scanned](model, optimizer, batch)
        checkpoint = tmp_path / f"ckpt-{'stacked' if saved_scanned else 'unrolled'}"
        mp.checkpoint.save(checkpoint, {"model": model, "optimizer": optimizer})
        twin, twin_optimizer = _zoo_gpt(not saved_scanned, meshes[not saved_scanned])
        mp.checkpoint.restore(checkpoint, {"model": twin, "optimizer": twin_optimizer})
        np.testing.assert_allclose(
            float(steps[not saved_scanned](twin, twin_optimizer, batches[2])),
            float(steps[saved_scanned](model, optimizer, batches[2])),
            rtol=1e-5,
            err_msg=f"saved {'stacked' if saved_scanned else 'unrolled'}",
        )
        with pytest.raises(  # 6 layers, not 4: the error says why they do not convert
            mp.CheckpointError,
            match=r"model\.blocks\.0\.attn.*as a ScanStack.*same number of layers in total",
        ):
            mp.checkpoint.restore(checkpoint, {"model": _zoo_gpt(not saved_scanned, 2, 6)[0]})
