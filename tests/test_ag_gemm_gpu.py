"""Fused AllGather+GEMM on GPUs against a float32 reference: the benchmark shapes, odd shapes,
batch dims, x_full, back-to-back calls with fresh data, mixing with XLA collectives, loops,
determinism, gradients, the compiled HLO, the GEMM-only mode and the bounded wait. Skipped
unless jaxflux.has_cuda() and at least 2 GPUs."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxflux
import fused_calls
import hlo_util
from jaxflux import _runtime, tuning
from jaxflux.ops.gemm import gemm
from gpu_util import (TOL, bench_shapes, check_back_to_back, check_matmul_grads, gpu_mesh,
                      operands, reference, rel_err)

pytestmark = pytest.mark.gpu

@pytest.fixture(autouse=True)
def _no_device_errors():
  """Every test also fails on any error a kernel recorded (a timed-out wait, a rank mismatch)."""
  _runtime.check_errors()
  yield
  _runtime.check_errors()


def _x_spec(ndim):
  spec = [None] * ndim
  spec[-2] = "tp"
  return P(*spec)


def _fused_fn(mesh, ndim, return_gathered=False, impl="fused"):
  """Global x [..., M, K] (rows sharded), w [K, N] (columns sharded) -> y [..., M, N]."""
  out_specs = (P(*([None] * (ndim - 1)), "tp"),)
  if return_gathered:
    out_specs += (P("tp"),)  # per-device x_full stacked on a new leading axis
  def body(x, w):
    out = jaxflux.all_gather_matmul(x, w, "tp", impl=impl, return_gathered=return_gathered)
    return (out[0], out[1][None]) if return_gathered else (out,)
  f = jax.shard_map(body, mesh=mesh, in_specs=(_x_spec(ndim), P(None, "tp")),
                    out_specs=out_specs)
  return jax.jit(lambda x, w: f(x, w) if return_gathered else f(x, w)[0])


@pytest.mark.parametrize("M,K,N", bench_shapes("ag_gemm"))
def test_benchmark_shapes_match_float32_reference(M, K, N):
  mesh = gpu_mesh()
  x, w = operands(M + N, (M, K), (K, N), jnp.bfloat16)
  got = _fused_fn(mesh, 2)(x, w)
  assert got.shape == (M, N) and got.dtype == jnp.bfloat16
  assert rel_err(got, reference(x, w)) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shard_rows,K,N,batch", [
    (200, 256, 512, ()),      # M/tp not a multiple of the 128-row tile: tiles straddle shards
    (128, 264, 136, ()),      # exactly one tile per shard; K, N not multiples of the tile
    (256, 128, 256, ()),      # two tiles per shard
    (384, 512, 1024, ()),     # three tiles per shard
    (1, 64, 64, ()),          # one row per shard
    (8, 4096, 2048, ()),      # decode-sized M, large K
    (7, 96, 40, (2, 3)),      # batch dims
    (64, 128, 256, (4,)),
    (256, 128, 256, (3,)),    # batch dims, own rows read straight from x (whole tiles)
    (8192, 1024, 512, ()),    # several chunks per shard (the pipelined copy)
])
def test_odd_shapes_and_batch_dims(dtype, shard_rows, K, N, batch):
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(shard_rows * K + N, batch + (tp * shard_rows, K), (K, N * tp), dtype)
  got = _fused_fn(mesh, x.ndim)(x, w)
  assert got.shape == batch + (tp * shard_rows, N * tp) and got.dtype == dtype
  assert rel_err(got, reference(x, w)) <= TOL[dtype]


@pytest.mark.parametrize("batch", [(), (3,)])
# 320 rows per shard: the own rows are copied into the gathered buffer first and x_full is one
# copy of it; 384 (three whole tiles): the GEMM reads them from x, and x_full is put together
# from the buffer's peer rows and x.
@pytest.mark.parametrize("shard_rows", [320, 384])
def test_x_full_is_the_exact_gather(batch, shard_rows):
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(3, batch + (tp * shard_rows, 256), (256, 128 * tp), jnp.bfloat16)
  y, x_full = _fused_fn(mesh, x.ndim, return_gathered=True)(x, w)
  np.testing.assert_array_equal(np.asarray(x_full), np.broadcast_to(np.asarray(x),
                                                                     x_full.shape))
  assert rel_err(y, reference(x, w)) <= TOL[jnp.bfloat16]


def test_back_to_back_calls_with_fresh_data_and_no_host_sync():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  f = _fused_fn(mesh, 2)
  make = jax.jit(lambda i: operands(i, (tp * 1024, 512), (512, 256 * tp), jnp.bfloat16))
  check_back_to_back(f, make)


def test_mixed_with_xla_collectives_and_in_fori_loop():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  K = 256

  def body(x, w):
    def step(_, h):
      y = jaxflux.all_gather_matmul(h, w, "tp", impl="fused")  # [tp*m, K]
      y = y + lax.psum(jnp.sum(h.astype(jnp.float32)), "tp").astype(y.dtype) * 0
      # Back to this device's token shard, scaled to keep values bounded.
      idx = lax.axis_index("tp")
      return (lax.dynamic_slice_in_dim(y, idx * h.shape[0], h.shape[0]) * 0.5).astype(h.dtype)
    return lax.fori_loop(0, 5, step, x)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, None)),
                            out_specs=P("tp")))
  x, w = operands(5, (tp * 256, K), (K, K), jnp.bfloat16)
  got = f(x, w)
  ref = x.astype(jnp.float32)
  w32 = w.astype(jnp.float32)
  for _ in range(5):
    ref = (jnp.matmul(ref, w32, precision=lax.Precision.HIGHEST) * 0.5).astype(
        jnp.bfloat16).astype(jnp.float32)
  assert rel_err(got, ref) <= 3e-2


def test_bitwise_deterministic_run_to_run():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  f = _fused_fn(mesh, 2)
  x, w = operands(9, (tp * 2048, 1024), (1024, 512 * tp), jnp.bfloat16)
  first = np.asarray(f(x, w))
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(f(x, w)), first)


def test_gradients_match_xla_path():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(11, (tp * 384, 256), (256, 128 * tp), jnp.bfloat16)
  ct = jax.random.normal(jax.random.key(12), (tp * 384, 128 * tp), jnp.float32)

  def loss(impl):
    f = _fused_fn(mesh, 2, impl=impl)
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct),
                            argnums=(0, 1)))

  dx, dw = loss("fused")(x, w)
  # Independent float32 reference of the same gradients.
  check_matmul_grads(dx, dw, x, w, ct)


def test_compiled_hlo_has_the_custom_call_and_no_all_gather():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(13, (tp * 256, 256), (256, 128 * tp), jnp.bfloat16)
  text = _fused_fn(mesh, 2).lower(x, w).compile().as_text()
  assert any(t.startswith("jaxflux_all_gather_matmul")
             for t in hlo_util.custom_call_targets(text))
  assert hlo_util.count_collectives(text).get("all-gather", 0) == 0


@pytest.mark.parametrize("M,K,N", [(1000, 264, 136), (4096, 1024, 2048)])
def test_gemm_only_mode_matches_float32_reference(M, K, N):
  gpu_mesh()
  x, w = operands(M, (M, K), (K, N), jnp.bfloat16)
  got = jax.jit(lambda x, w: gemm(x, w, kernel="all_gather_matmul"))(x, w)
  assert rel_err(got, reference(x, w)) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("tile", tuning.AG_TILES)
@pytest.mark.parametrize("local_read", ["direct", "copy"])
@pytest.mark.parametrize("shard_rows,K,N,batch", [
    (200, 264, 136, ()),      # tiles straddle shards; K, N not multiples of any tile
    (1024, 1024, 1024, ()),
    (7, 96, 40, (2, 3)),      # batch dims
])
def test_every_tile_config_matches_reference(tile, local_read, shard_rows, K, N, batch):
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(K + N, batch + (tp * shard_rows, K), (K, N * tp), jnp.bfloat16)
  spec = _x_spec(x.ndim)
  w0 = w[:, :N]
  with tuning.override("all_gather_matmul", tile=tile, local_read=local_read):
    body = lambda x, w: fused_calls.all_gather_matmul(x, w, "tp", False)[0]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P(None, "tp")),
                              out_specs=P(*([None] * (x.ndim - 1)), "tp")))
    got = f(x, w)
    only = jax.jit(lambda x, w: gemm(x, w, kernel="all_gather_matmul"))(x, w0)
  assert rel_err(got, reference(x, w)) <= TOL[jnp.bfloat16]
  assert rel_err(only, reference(x, w0)) <= TOL[jnp.bfloat16]


@pytest.mark.parametrize("tile", tuning.AG_TILES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shard_rows,K,N,batch", [
    (200, 264, 136, ()),      # K, N not multiples of any tile
    (1024, 4096, 2048, ()),
    (7, 96, 40, (2, 3)),      # batch dims
])
def test_weight_given_transposed_matches_reference(tile, dtype, shard_rows, K, N, batch):
  """transpose_w: w is [N, K] (the backward's forward weight, read K-major by the kernel)."""
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(K + N + 1, batch + (tp * shard_rows, K), (K, N * tp), dtype)
  wt = jnp.asarray(w.T)  # [N*tp, K]: the kernel gets this array, never w
  spec = _x_spec(x.ndim)
  with tuning.override("all_gather_matmul", tile=tile):
    body = lambda x, wt: fused_calls.all_gather_matmul(x, wt, "tp", False, transpose_w=True)[0]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P("tp", None)),
                              out_specs=P(*([None] * (x.ndim - 1)), "tp")))
    got = f(x, wt)
  assert rel_err(got, reference(x, w)) <= TOL[dtype]


def test_a_peer_that_never_signals_times_out_instead_of_hanging():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  jaxflux.configure(timeout_s=2.0)
  try:
    x, w = operands(17, (tp * 256, 256), (256, 128 * tp), jnp.bfloat16)

    def make(skip):
      body = lambda x, w: fused_calls.all_gather_matmul(x, w, "tp", False, debug_skip_rank=skip)[0]
      return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
                                   out_specs=P(None, "tp")))

    good, hang = make(-1), make(0)
    good(x, w).block_until_ready()
    start = time.monotonic()
    hang(x, w).block_until_ready()
    assert time.monotonic() - start < 15.0
    with pytest.raises(RuntimeError, match=r"all_gather_matmul: rank 1 .* timed out .* rank 0"):
      _runtime.check_errors()
    # Epochs stay aligned: the next call is correct again.
    assert rel_err(good(x, w), reference(x, w)) <= TOL[jnp.bfloat16]
  finally:
    jaxflux.configure(timeout_s=30.0)
    _runtime.check_errors()
