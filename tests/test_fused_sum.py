"""jaxflux.ops._fused_sum on 4 CPU devices, with XLA's invariant all-gather standing in for the
fused one (both give every rank the same gathered value, typed invariant over the axis): psum
and broadcast against lax.psum and the implicit broadcast, values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from jaxflux.ops import _fused_sum, all_gather

try:  # the stand-in: XLA's all-gather typed as the fused one's FFI result is
  from jax._src.lax.parallel import all_gather_invariant
except ImportError:  # pragma: no cover - a JAX without it
  all_gather_invariant = None

RANKS = 4


@pytest.fixture
def xla_gather(monkeypatch):
  if all_gather_invariant is None:
    pytest.skip("this JAX has no invariant all-gather to stand in for the fused one")
  monkeypatch.setattr(all_gather, "all_gather", lambda x, axis, impl: all_gather_invariant(
      x, axis, axis=x.ndim - 2, tiled=True))


def shard_mapped(fn, in_specs, out_specs):
  mesh = make_mesh((RANKS,), ("tp",))
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def test_psum_equals_lax_psum_with_its_gradient(xla_gather):
  v = jax.random.normal(jax.random.key(0), (RANKS, 5, 3))
  ct = jax.random.normal(jax.random.key(1), (5, 3))
  ours = shard_mapped(lambda v: _fused_sum.psum(v[0], "tp"), (P("tp"),), P())
  xla = shard_mapped(lambda v: jax.lax.psum(v[0], "tp"), (P("tp"),), P())
  np.testing.assert_allclose(ours(v), xla(v), rtol=1e-6)
  np.testing.assert_allclose(ours(v), np.sum(np.asarray(v), 0), rtol=1e-6)
  grad = jax.grad(lambda v: jnp.sum(ours(v) * ct))(v)
  np.testing.assert_allclose(grad, jax.grad(lambda v: jnp.sum(xla(v) * ct))(v), rtol=1e-6)
  np.testing.assert_allclose(grad, np.broadcast_to(np.asarray(ct), v.shape), rtol=1e-6)


def test_broadcast_gradient_is_the_sum_over_ranks(xla_gather):
  """A replicated kernel used with each rank's rows: forward unchanged, its gradient the sum of
  every rank's (as the implicit broadcast's psum gives), the same on every rank."""
  w = jax.random.normal(jax.random.key(2), (6, 3))
  x = jax.random.normal(jax.random.key(3), (RANKS * 5, 6))

  def loss(broadcast):
    def local(w, x):
      y = x @ (broadcast(w) if broadcast else w)
      return jnp.sum(jnp.tanh(y) ** 2, keepdims=True)[None]
    per_rank = shard_mapped(local, (P(), P("tp")), P("tp"))
    return lambda w, x: jnp.sum(per_rank(w, x))

  ours = loss(lambda w: _fused_sum.broadcast(w, "tp"))
  xla = loss(None)
  np.testing.assert_allclose(ours(w, x), xla(w, x), rtol=1e-6)
  got, want = jax.grad(ours)(w, x), jax.grad(xla)(w, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  dense = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
  np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-6)
