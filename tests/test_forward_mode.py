"""Forward-mode differentiation of the ops: refused with a message that says so, by all three.

The ops are custom_vjps, which JAX differentiates in reverse mode only. Under jit JAX raises its
own forward-mode error; under an eager shard_map its error path failed first with an unrelated
`unhashable type` TypeError, so jaxflux checks before binding. Forward over reverse (jax.hessian)
reaches the ops' fwd rules with jvp tracers; it once ran through matmul_all_reduce's reference
path and failed deep inside all_gather_matmul's backward, so each fwd rule checks too. Reverse
mode must keep working eagerly, also with JAX's older jvp-then-partial-eval linearization, which
passes jvp tracers too, and to second order (jax.jacrev of jax.jacrev).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import make_mesh

TP = 4
# (op, per-device call, x shape, w shape, in_specs, out_specs, reference on global arrays)
OPS = {
    "all_gather_matmul": (
        lambda x, w: jaxflux.all_gather_matmul(x, w, "tp"),
        (2, 32, 16), (16, 24), (P(None, "tp"), P(None, "tp")), P(None, None, "tp"),
        lambda x, w: x @ w),
    "all_gather_matmul(return_gathered)": (
        lambda x, w: jaxflux.all_gather_matmul(x, w, "tp", return_gathered=True)[0],
        (2, 32, 16), (16, 24), (P(None, "tp"), P(None, "tp")), P(None, None, "tp"),
        lambda x, w: x @ w),
    "matmul_reduce_scatter": (
        lambda x, w: jaxflux.matmul_reduce_scatter(x, w, "tp"),
        (2, 32, 24), (24, 16), (P(None, None, "tp"), P("tp")), P(None, "tp"),
        lambda x, w: x @ w),
    "matmul_all_reduce": (
        lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp"),
        (2, 32, 24), (24, 16), (P(None, None, "tp"), P("tp")), P(),
        lambda x, w: x @ w),
}


def _case(name):
  local, x_shape, w_shape, in_specs, out_specs, reference = OPS[name]
  mesh = make_mesh((TP,), ("tp",))
  f = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  rng = np.random.default_rng(list(OPS).index(name))
  x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
  w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
  return f, reference, x, w


@pytest.mark.parametrize("name", list(OPS))
def test_eager_jvp_names_the_op_and_reverse_mode(name):
  f, _, x, w = _case(name)
  op = name.split("(")[0]
  with pytest.raises(TypeError, match=rf"jaxflux\.{op}: can't apply forward-mode autodiff \(jvp\)"
                     r".*reverse mode only\. Use jax\.grad, jax\.vjp or jax\.jacrev"):
    jax.jvp(f, (x, w), (x, w))


@pytest.mark.parametrize("name", list(OPS))
def test_jitted_jvp_raises_the_custom_vjp_error(name):
  f, _, x, w = _case(name)
  with pytest.raises(TypeError, match=r"can't apply forward-mode autodiff \(jvp\)"):
    jax.jvp(jax.jit(f), (x, w), (x, w))
  # jvp traced inside jit reaches the op with tangents attached: jaxflux's message.
  with pytest.raises(TypeError, match=r"jaxflux\.\w+: can't apply forward-mode autodiff"):
    jax.jit(lambda x, w: jax.jvp(f, (x, w), (x, w)))(x, w)


def test_jacfwd_is_refused_and_jacrev_matches_the_reference():
  f, reference, x, w = _case("all_gather_matmul")
  with pytest.raises(TypeError, match=r"jaxflux\.all_gather_matmul: can't apply forward-mode"):
    jax.jacfwd(lambda w: f(x, w).sum())(w)
  got = jax.jacrev(lambda w: jnp.tanh(f(x, w)).sum())(w)
  want = jax.jacrev(lambda w: jnp.tanh(reference(x, w)).sum())(w)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(OPS))
def test_hessian_names_the_op_and_second_order_reverse_matches(name):
  """jax.hessian (jacfwd of jacrev) is refused with the op's name, eager or jitted; jacrev of
  jacrev, the reverse-mode second derivative, matches the reference."""
  f, reference, x, w = _case(name)
  w = w[:, :4]  # a small Hessian: 4 columns, one per device for the column-sharded weight
  op = name.split("(")[0]
  loss = lambda matmul: (lambda w: jnp.sum(jnp.sin(matmul(x, w))))  # noqa: E731
  for wrap in (lambda g: g, jax.jit):
    with pytest.raises(TypeError, match=rf"jaxflux\.{op}: can't apply forward-mode autodiff.*"
                                        r"jax\.jacrev\(jax\.jacrev\(f\)\)"):
      wrap(jax.hessian(loss(f)))(w)
  got = jax.jit(jax.jacrev(jax.jacrev(loss(f))))(w)
  want = jax.jacrev(jax.jacrev(loss(reference)))(w)
  assert float(jnp.abs(want).max()) > 0
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("direct_linearize", [True, False], ids=["direct", "jvp-partial-eval"])
@pytest.mark.parametrize("name", list(OPS))
def test_eager_reverse_mode_still_works(name, direct_linearize):
  """jax.grad through the eager shard_map, against the same loss on plain global matmuls."""
  f, reference, x, w = _case(name)
  rng = np.random.default_rng(1)
  probe = jnp.asarray(rng.standard_normal(reference(x, w).shape), jnp.float32)

  def loss(matmul):
    return lambda x, w: jnp.sum(jnp.sin(matmul(x, w)) * probe)

  before = jax.config.jax_use_direct_linearize
  jax.config.update("jax_use_direct_linearize", direct_linearize)
  try:
    got = jax.grad(loss(f), (0, 1))(x, w)
  finally:
    jax.config.update("jax_use_direct_linearize", before)
  want = jax.grad(loss(reference), (0, 1))(x, w)
  for g, r in zip(got, want):
    assert float(jnp.abs(r).max()) > 0
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_layer_jvp_is_refused():
  """The Flax layer runs the op inside its own shard_map: the same message, eager or jitted."""
  import flax.linen as nn

  mesh = make_mesh((TP,), ("tp",))
  layer = jaxflux.Dense(16, tensor_parallel="column")
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 32, 8)), jnp.float32)
  with jax.set_mesh(mesh):
    params = nn.unbox(jax.jit(layer.init)(jax.random.key(0), x))
    with pytest.raises(TypeError, match=r"forward-mode autodiff \(jvp\)"):
      jax.jvp(lambda x: layer.apply(params, x), (x,), (x,))
    with pytest.raises(TypeError, match=r"forward-mode autodiff \(jvp\)"):
      jax.jvp(jax.jit(lambda x: layer.apply(params, x)), (x,), (x,))
