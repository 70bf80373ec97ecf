"""Values and gradients of both ops (pure-JAX path) against float64 NumPy on random data."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import make_mesh

TPS = (2, 4, 8)


def rand(key, shape, dtype=np.float32):
  return np.asarray(jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def lead(nbatch):
  return (None,) * nbatch


def ag_fn(mesh, nbatch, **kw):
  """Global-view wrapper: x [..., M, K] sharded on M, w [K, N] sharded on N → y sharded on N."""
  def body(x, w):
    return jaxflux.all_gather_matmul(x, w, "tp", **kw)
  out = P(*lead(nbatch), None, "tp")
  if kw.get("return_gathered"):
    # x_full is varying over tp (like lax.all_gather's result): stack the per-device copies.
    out = (out, P(*lead(nbatch), "tp", None))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(*lead(nbatch), "tp", None),
                                                          P(None, "tp")), out_specs=out))


def rs_fn(mesh, nbatch, **kw):
  """Global-view wrapper: x [..., M, K] sharded on K, w [K, N] sharded on K → z sharded on M."""
  def body(x, w):
    return jaxflux.matmul_reduce_scatter(x, w, "tp", **kw)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(*lead(nbatch), None, "tp"),
                                                          P("tp", None)),
                               out_specs=P(*lead(nbatch), "tp", None)))


def f64(a):
  return np.asarray(a, np.float64)


def ref_grads(x, w, r):
  """d/dx, d/dw of sum(r * (x @ w)) for x [..., M, K]."""
  dx = f64(r) @ f64(w).T
  k, n = x.shape[-1], r.shape[-1]
  dw = f64(x).reshape(-1, k).T @ f64(r).reshape(-1, n)
  return dx, dw


SHAPES = [  # (batch dims, tokens per device, K, N per device)
    ((), 8, 16, 8),
    ((), 3, 24, 5),     # tokens per device and N not multiples of 8
    ((2,), 4, 16, 8),   # one batch axis
    ((2, 3), 1, 8, 4),  # two batch axes, one token per device
]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("batch,m,k,n", SHAPES)
def test_all_gather_matmul_values_and_grads(tp, batch, m, k, n):
  mesh = make_mesh((tp,), ("tp",))
  x = rand(1, (*batch, tp * m, k))
  w = rand(2, (k, tp * n))
  r = rand(3, (*batch, tp * m, tp * n))
  f = ag_fn(mesh, len(batch))
  np.testing.assert_allclose(f(x, w), f64(x) @ f64(w), rtol=1e-5, atol=1e-5)
  dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w) * r), argnums=(0, 1))(x, w)
  ref_dx, ref_dw = ref_grads(x, w, r)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("batch,m,k,n", SHAPES)
def test_matmul_reduce_scatter_values_and_grads(tp, batch, m, k, n):
  mesh = make_mesh((tp,), ("tp",))
  x = rand(4, (*batch, tp * m, tp * k))
  w = rand(5, (tp * k, n))
  r = rand(6, (*batch, tp * m, n))
  f = rs_fn(mesh, len(batch))
  np.testing.assert_allclose(f(x, w), f64(x) @ f64(w), rtol=1e-5, atol=1e-4)
  dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w) * r), argnums=(0, 1))(x, w)
  ref_dx, ref_dw = ref_grads(x, w, r)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tp", TPS)
def test_return_gathered_values_and_grads(tp):
  mesh = make_mesh((tp,), ("tp",))
  x = rand(7, (2, tp * 3, 16))
  w = rand(8, (16, tp * 4))
  r_y = rand(9, (2, tp * 3, tp * 4))
  r_x_copies = rand(10, (2, tp * tp * 3, 16))
  r_x = sum(np.split(r_x_copies, tp, axis=1))
  f = ag_fn(mesh, 1, return_gathered=True)
  y, x_full = f(x, w)
  np.testing.assert_allclose(y, f64(x) @ f64(w), rtol=1e-5, atol=1e-5)
  for copy in np.split(np.asarray(x_full), tp, axis=1):
    np.testing.assert_array_equal(copy, x)

  def loss(x, w):
    y, x_full = f(x, w)
    # Each device's copy of x_full is weighted differently, so every copy's cotangent counts.
    return jnp.sum(y * r_y) + jnp.sum(x_full * r_x_copies)
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
  ref_dx, ref_dw = ref_grads(x, w, r_y)
  np.testing.assert_allclose(dx, ref_dx + r_x, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-4)


def test_replicated_weight_gradient_is_summed_over_devices():
  """A weight replicated over tp gets the full gradient (the transpose of the implicit pvary)."""
  tp = 4
  mesh = make_mesh((tp,), ("tp",))
  x = rand(11, (tp * 2, 8))
  w = rand(12, (8, 6))
  r = rand(13, (tp * 2, 6 * tp))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("tp", None), P()), out_specs=P(None, "tp"))
  def f(x, w):
    return jaxflux.all_gather_matmul(x, w, "tp")
  # Every device multiplies by the same w, so y = [x @ w] * tp along columns.
  np.testing.assert_allclose(f(x, w), np.tile(f64(x) @ f64(w), (1, tp)), rtol=1e-5, atol=1e-5)
  dw = jax.grad(lambda w: jnp.sum(f(x, w) * r))(w)
  ref = sum(f64(x).T @ f64(r[:, i * 6:(i + 1) * 6]) for i in range(tp))
  np.testing.assert_allclose(dw, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_preferred_element_type_and_bf16(op):
  tp = 2
  mesh = make_mesh((tp,), ("tp",))
  x = rand(14, (tp * 4, 16)).astype(jnp.bfloat16)
  w = rand(15, (16, tp * 8)).astype(jnp.bfloat16)
  f = (ag_fn if op == "ag" else rs_fn)(mesh, 0, preferred_element_type=jnp.float32)
  y = f(x, w)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, f64(x.astype(np.float32)) @ f64(w.astype(np.float32)),
                             rtol=2e-2, atol=2e-2)
  assert (ag_fn if op == "ag" else rs_fn)(mesh, 0)(x, w).dtype == jnp.bfloat16
  dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1))(x, w)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16


def test_gradient_agrees_with_finite_differences():
  """The custom_vjp gradient of a nonlinear loss matches a central finite difference."""
  tp = 2
  mesh = make_mesh((tp,), ("tp",))
  x = rand(16, (tp * 2, 8))
  w = rand(17, (8, 6 * tp))
  f = ag_fn(mesh, 0)
  tx = rand(18, x.shape)
  # Directional derivative along tx: <grad, tx> from the VJP vs the forward's finite difference.
  g = jax.grad(lambda x: jnp.sum(f(x, w) ** 2))(x)
  eps = 1e-3
  fd = (jnp.sum(f(x + eps * tx, w) ** 2) - jnp.sum(f(x - eps * tx, w) ** 2)) / (2 * eps)
  np.testing.assert_allclose(np.sum(g * tx), fd, rtol=1e-3)


@pytest.mark.parametrize("tp", (2, 4))
def test_second_order_gradients_of_a_column_row_mlp(tp):
  """grad of grad through both ops: each backward hands its weight to the partner op transposed
  (transpose_w), and that op's own backward flips it back. Against the same function in plain
  jnp (float32, no shard_map)."""
  mesh = make_mesh((tp,), ("tp",))
  x = rand(30, (2 * tp, 8))
  w1 = rand(31, (8, 3 * tp)) / 3
  w2 = rand(32, (3 * tp, 8)) / 3

  def body(x, w1, w2):
    h = jnp.tanh(jaxflux.all_gather_matmul(x, w1, "tp"))
    return jaxflux.matmul_reduce_scatter(h, w2, "tp")
  mlp = jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)),
                      out_specs=P("tp", None))
  ref = lambda x, w1, w2: jnp.tanh(x @ w1) @ w2  # noqa: E731

  def outer(f):
    # A scalar of the first-order gradients, differentiated again w.r.t. every input.
    inner = jax.grad(lambda x, w1, w2: jnp.sum(jnp.sin(f(x, w1, w2))), argnums=(0, 1, 2))
    return jax.grad(lambda *a: sum(jnp.sum(g ** 2) for g in inner(*a)), argnums=(0, 1, 2))

  got = jax.jit(outer(mlp))(x, w1, w2)
  want = outer(ref)(x, w1, w2)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_float64_gradients_keep_float64_precision(op):
  """The reference path in float64 (x64 on): dx and dw both to float64 rounding (dw once
  accumulated in float32: ~1e-8)."""
  mesh = make_mesh((4,), ("tp",))
  with jax.enable_x64(True):
    x, w, r = (rand(i, s, np.float64) for i, s in enumerate([(32, 16), (16, 8), (32, 8)]))
    if op == "all_gather_matmul":
      f, r = ag_fn(mesh, 0), rand(3, (32, 8 * 4), np.float64)
      w = rand(4, (16, 8 * 4), np.float64)
    else:
      f = rs_fn(mesh, 0)
    dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w) * r), argnums=(0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.float64
    want_dx, want_dw = ref_grads(x, w, r)
    np.testing.assert_allclose(f64(dx), want_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f64(dw), want_dw, rtol=1e-12, atol=1e-12)
