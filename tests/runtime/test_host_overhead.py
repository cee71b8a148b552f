"""The host work per call: placed avals and step signatures are cheap and never stale.

`placed_aval` hands out one `PlacedAval` per placement (its key computed once);
`mp.jit`'s cache key hashes its graphdef once per distinct graphdef. Any change
of the arguments' structure, shapes or placements is still a new signature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_models import MLP, WIDTH, make_mesh, mlp_loss

import nnx_mpmd as mp
from nnx_mpmd.placement.abstract import PlacedAval, placed_aval


def test_one_placed_aval_per_placement_with_its_key_computed_once():
    mesh = make_mesh(2, 2)
    sharding = NamedSharding(mesh.submesh(1), P("data"))
    a, b = (jax.device_put(jnp.full(4, v), sharding) for v in (1.0, 2.0))
    aval = placed_aval(a, mesh)
    assert placed_aval(b, mesh) is aval
    assert aval.mesh_ids == (1,) and aval.key() is aval.key()
    fresh = PlacedAval(aval.shape, aval.dtype, aval.shardings, aval.weak_type)
    assert fresh == aval and fresh.key() == aval.key()
    other = placed_aval(jax.device_put(jnp.full(4, 1.0), NamedSharding(mesh.submesh(0), P())), mesh)
    assert other.mesh_ids == (0,) and other.key() != aval.key()
    assert placed_aval(jnp.full(4, 1, jnp.int32), mesh).key() != placed_aval(a, mesh).key()
    # The same arrays seen through another mesh: that mesh's own answer.
    assert placed_aval(a, make_mesh(4, 1)).mesh_ids == ()


def test_a_deleted_array_still_gets_an_aval():
    mesh = make_mesh(2, 1)
    x = jax.device_put(jnp.ones(3), mesh.submesh(0).devices.flat[0])
    x.delete()
    assert placed_aval(x, mesh).shape == (3,)


def _step(model, opt, batch):
    loss, grads = mp.value_and_grad(mlp_loss)(model, batch)
    opt.update(model, grads)
    return loss


class Scaled(MLP):
    def __call__(self, x):
        return super().__call__(x) * self.scale


def test_a_changed_graph_is_a_new_signature_never_a_stale_one():
    model = Scaled(2, rngs=nnx.Rngs(0))
    model.scale = 1.0  # a static attribute: part of the graphdef
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    step = mp.jit(_step, mesh=make_mesh(2, 1), schedule=mp.GPipe(), num_microbatches=2)
    batch = {"x": jnp.ones((4, WIDTH)), "y": jnp.zeros((4, WIDTH))}
    first = float(step(model, opt, batch))
    assert float(step(model, opt, batch)) == first and step.num_compiled_steps == 1
    model.scale = 2.0  # same leaves, another graphdef
    assert step.num_compiled_steps == 1
    second = float(step(model, opt, batch))
    assert step.num_compiled_steps == 2
    np.testing.assert_allclose(second, 4 * first, rtol=1e-5)
    model.scale = 1.0  # back to the first graph: its lowering, the same numbers
    assert float(step(model, opt, batch)) == first and step.num_compiled_steps == 2
