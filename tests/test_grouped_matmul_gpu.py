"""The grouped GEMM kernel (grouped_matmul(impl="fused")) on one GPU against per-group float64
references of the same 16-bit operands: forward, dx and dw, both weight layouts and tile
configs, empty groups, rows past the groups, traced group sizes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from jaxflux import tuning
from jaxflux.ops import _grouped_kernel
from jaxflux.ops.grouped_matmul import grouped_matmul
from gpu_util import TOL, rel_err

# (M, K, N, group sizes): groups of a few rows and of several tiles, empty groups (first, last,
# in between), a sum below M (zero rows after), one group, and 8 groups of 2048 rows.
CASES = [
    pytest.param(300, 256, 384, (100, 0, 37, 163), id="odd-sizes-empty-middle"),
    pytest.param(257, 128, 136, (0, 1, 255, 0), id="one-row-group-empty-ends"),
    pytest.param(520, 64, 256, (200, 100), id="sum-below-m"),
    pytest.param(1000, 512, 264, (1000,), id="one-group"),
    pytest.param(4096, 1024, 512, (0,) * 30 + (4096,) + (0,) * 33, id="64-groups-one-full"),
]


def operands(seed, m, k, n, g, dtype, transpose_w):
  kx, kw = jax.random.split(jax.random.key(seed))
  w_shape = (g, n, k) if transpose_w else (g, k, n)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, w_shape, jnp.float32) / np.sqrt(k)).astype(dtype)
  return x, w


def reference(x, w, sizes, transpose_w):
  """float64 per-group products of the same 16-bit values; rows past the groups are zero."""
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  if transpose_w:
    w = w.transpose(0, 2, 1)
  out = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for g, size in enumerate(sizes):
    out[start:start + size] = x[start:start + size] @ w[g]
    start += size
  return out


def reference_grads(x, w, sizes, ct, transpose_w):
  """(dx, dw) of sum(y * ct) in float64, dw in w's layout."""
  x = np.asarray(x, np.float64)
  w64 = np.asarray(w, np.float64)
  wk = w64.transpose(0, 2, 1) if transpose_w else w64
  ct = np.asarray(ct, np.float64)
  dx = np.zeros_like(x)
  dw = np.zeros_like(wk)
  start = 0
  for g, size in enumerate(sizes):
    rows = slice(start, start + size)
    dx[rows] = ct[rows] @ wk[g].T
    dw[g] = x[rows].T @ ct[rows]
    start += size
  return dx, (dw.transpose(0, 2, 1) if transpose_w else dw)


@pytest.mark.gpu
@pytest.mark.quick_once("tile")
@pytest.mark.parametrize("tile", tuning.GROUPED_TILES)
@pytest.mark.parametrize("transpose_w", [False, True], ids=["w-GKN", "w-GNK"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_forward_and_grads_match_float64(m, k, n, sizes, dtype, transpose_w, tile):
  x, w = operands(len(sizes) + m, m, k, n, len(sizes), dtype, transpose_w)
  gs = jnp.asarray(sizes, jnp.int32)
  ct = jax.random.normal(jax.random.key(m + n), (m, n), jnp.float32).astype(dtype)

  def loss(x, w, gs):
    y = _grouped_kernel.grouped_matmul(x, w, gs, transpose_w, tile)
    return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w, gs)
  assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
  total = sum(sizes)
  want = reference(x, w, sizes, transpose_w)
  assert rel_err(y[:total], want[:total]) <= TOL[dtype]
  assert not np.any(np.asarray(y[total:], np.float32)), "rows past the groups must be zero"
  dx_want, dw_want = reference_grads(x, w, sizes, ct, transpose_w)
  assert rel_err(dx[:total], dx_want[:total]) <= TOL[dtype]
  assert not np.any(np.asarray(dx[total:], np.float32))
  for g, size in enumerate(sizes):
    if size == 0:
      assert not np.any(np.asarray(dw[g], np.float32)), f"empty group {g}: dw must be zero"
    else:
      assert rel_err(dw[g], dw_want[g]) <= TOL[dtype], f"group {g}"


@pytest.mark.gpu
def test_public_op_runs_the_kernel_and_matches_ragged_dot():
  m, k, n, sizes = 1024, 512, 768, (300, 0, 500, 124, 100)
  x, w = operands(3, m, k, n, len(sizes), jnp.bfloat16, False)
  gs = jnp.asarray(sizes, jnp.int32)
  f = jax.jit(grouped_matmul, static_argnames=("impl",))
  hlo = f.lower(x, w, gs, impl="fused").as_text()
  assert "jaxflux_grouped_gemm" in hlo
  assert "jaxflux_grouped_gemm" in f.lower(x, w, gs, impl="auto").as_text()
  got = f(x, w, gs, impl="fused")
  want = f(x, w, gs, impl="xla")
  assert rel_err(got, want) <= TOL[jnp.bfloat16]


@pytest.mark.gpu
def test_routing_is_traced_and_each_call_uses_its_sizes():
  """One compiled program, group sizes changing call to call (no recompile, no host sync)."""
  m, k, n, g = 640, 256, 256, 8
  x, w = operands(5, m, k, n, g, jnp.bfloat16, False)
  f = jax.jit(lambda x, w, gs: grouped_matmul(x, w, gs, impl="fused"))
  rng = np.random.default_rng(0)
  for _ in range(4):
    sizes = rng.multinomial(m - int(rng.integers(0, 64)), np.full(g, 1 / g))
    got = f(x, w, jnp.asarray(sizes, jnp.int32))
    total = int(sizes.sum())
    assert rel_err(got[:total], reference(x, w, sizes, False)[:total]) <= TOL[jnp.bfloat16]
    assert not np.any(np.asarray(got[total:], np.float32))
  assert f._cache_size() == 1


@pytest.mark.gpu
@pytest.mark.slow
def test_bitwise_deterministic_and_fresh():
  m, k, n, sizes = 2048, 1024, 1024, (512, 1024, 0, 512)
  f = jax.jit(lambda x, w, gs: grouped_matmul(x, w, gs, impl="fused"))
  gs = jnp.asarray(sizes, jnp.int32)
  x, w = operands(7, m, k, n, len(sizes), jnp.bfloat16, False)
  first = np.asarray(f(x, w, gs))
  assert np.array_equal(first, np.asarray(f(x, w, gs)))
  x2, _ = operands(8, m, k, n, len(sizes), jnp.bfloat16, False)
  second = f(x2, w, gs)
  assert rel_err(second, reference(x2, w, sizes, False)) <= TOL[jnp.bfloat16]
  assert not np.array_equal(first, np.asarray(second))


@pytest.mark.gpu
@pytest.mark.slow
def test_many_small_groups_and_no_rows():
  """128 experts of ~16 rows (the decode side of an MoE layer), and a call with no rows."""
  g, k, n = 128, 512, 256
  rng = np.random.default_rng(1)
  sizes = rng.multinomial(2048, rng.dirichlet(np.full(g, 0.5)))
  x, w = operands(9, 2048, k, n, g, jnp.bfloat16, True)
  got = grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), impl="fused", transpose_w=True)
  assert rel_err(got, reference(x, w, sizes, True)) <= TOL[jnp.bfloat16]
  none = grouped_matmul(x[:0], w, jnp.zeros((g,), jnp.int32), impl="fused", transpose_w=True)
  assert none.shape == (0, n)
  zeros = grouped_matmul(x, w, jnp.zeros((g,), jnp.int32), impl="fused", transpose_w=True)
  assert not np.any(np.asarray(zeros, np.float32))


@pytest.mark.gpu
@pytest.mark.quick_once()
@pytest.mark.parametrize("w_spec,loss_axes", [(P(), ("dp",)), (P("tp"), ("dp", "tp"))],
                         ids=["w-replicated", "w-expert-sharded"])
def test_gradients_under_shard_map(w_spec, loss_axes):
  """Inside shard_map the kernel's results are typed like the XLA path's: the forward varies as
  its operands, dx like x, dw like w (summed over the token shards when w is replicated)."""
  mesh = jax.make_mesh((1, 1), ("dp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto),
                       devices=jax.devices()[:1])
  m, k, n, sizes = 512, 256, 256, (200, 0, 312)
  x, w = operands(11, m, k, n, len(sizes), jnp.bfloat16, False)
  gs = jnp.asarray(sizes, jnp.int32)

  def loss(x, w, gs, impl):
    def local(x, w, gs):
      y = grouped_matmul(x, w, gs, impl=impl).astype(jnp.float32)
      return jax.lax.psum(jnp.sum(y * y), loss_axes)  # the axes y varies along
    return jax.shard_map(local, mesh=mesh, in_specs=(P("dp"), w_spec, P()), out_specs=P())(
        x, w, gs)

  grads = {impl: jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)(x, w, gs, impl)
           for impl in ("fused", "xla")}
  for got, want in zip(grads["fused"], grads["xla"]):
    assert rel_err(got, want) <= 2e-2


# (M, K, N, group sizes) of the FP8 forward: K a multiple of 16.
FP8_CASES = [
    pytest.param(300, 256, 384, (100, 0, 37, 163), id="odd-sizes-empty-middle"),
    pytest.param(520, 128, 264, (200, 100), id="sum-below-m"),
    pytest.param(4096, 1024, 512, (0,) * 7 + (1000, 3000) + (0,) * 7 + (96,), id="17-groups",
                 marks=pytest.mark.slow),
]


@pytest.mark.gpu
@pytest.mark.quick_once("tile")
@pytest.mark.parametrize("tile", tuning.GROUPED_TILES)
@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor", "per-row-col"])
@pytest.mark.parametrize("m,k,n,sizes", FP8_CASES)
def test_fp8_forward_matches_float64(m, k, n, sizes, per_row, tile):
  """e4m3 x and w [G, N, K], the scales in the kernel's epilogue, against float64 products of
  the dequantized values (every element, through the relative Frobenius error), and rows past
  the groups zero."""
  g = len(sizes)
  rng = np.random.default_rng(m + k + g)
  x = jnp.asarray(rng.standard_normal((m, k)) * 2, jnp.float8_e4m3fn)
  w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.float8_e4m3fn)
  if per_row:
    xs = jnp.asarray(rng.uniform(0.01, 0.1, (m, 1)), jnp.float32)
    ws = jnp.asarray(rng.uniform(0.01, 0.1, (g, 1, n)), jnp.float32)
  else:
    xs, ws = jnp.float32(0.05), jnp.float32(0.02)
  gs = jnp.asarray(sizes, jnp.int32)
  rows = jnp.broadcast_to(xs, (m, 1)).reshape(m)
  cols = jnp.broadcast_to(ws, (g, 1, n)).reshape(g, n)
  y = jax.jit(lambda *a: _grouped_kernel.forward_fp8(*a, tile))(x, w, gs, rows, cols)
  assert y.dtype == jnp.bfloat16
  x64 = np.asarray(x.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)
  w64 = (np.asarray(w.astype(jnp.float32), np.float64).transpose(0, 2, 1)
         * np.broadcast_to(np.asarray(ws, np.float64), (g, 1, n)))
  total = sum(sizes)
  want = np.zeros((m, n))
  start = 0
  for e, size in enumerate(sizes):
    want[start:start + size] = x64[start:start + size] @ w64[e]
    start += size
  assert rel_err(y[:total], want[:total]) <= TOL[jnp.bfloat16]
  assert not np.any(np.asarray(y[total:], np.float32)), "rows past the groups must be zero"
  # The public op runs the kernel with impl="fused" (impl="auto" takes XLA for FP8: no timing
  # backs a rule) and agrees with its XLA path.
  op = jax.jit(lambda *a, impl: grouped_matmul(*a[:3], x_scale=a[3], w_scale=a[4], impl=impl,
                                               transpose_w=True), static_argnames="impl")
  for impl, kernel in (("fused", True), ("auto", False)):
    assert ("jaxflux_grouped_gemm" in op.lower(x, w, gs, xs, ws, impl=impl).as_text()) == kernel
  fused, ref = (op(x, w, gs, xs, ws, impl=impl) for impl in ("fused", "xla"))
  assert rel_err(fused[:total], want[:total]) <= TOL[jnp.bfloat16]
  assert rel_err(ref[:total], want[:total]) <= TOL[jnp.bfloat16]
