"""Fused GEMM+AllReduce on GPUs against a float32 reference: the gemm_rs benchmark shapes from
decode to prefill rows, odd shapes, batch dims, fp16, both tiles and pushes, the weight given
transposed; every rank's copy of the output bitwise the same; back-to-back calls with fresh
data, a lax.scan decode loop, gradients, the compiled HLO and the bounded wait. Skipped unless
jaxflux.has_cuda() and at least 2 GPUs (the op's GEMM alone: tests/test_gemm_gpu.py)."""
import json
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
from jaxflux.ops import _common
from gpu_util import (ROOT, TOL, check_back_to_back, check_matmul_grads, gpu_mesh, operands,
                      reference, rel_err)

pytestmark = pytest.mark.gpu
TARGET = "jaxflux_matmul_all_reduce"


@pytest.fixture(autouse=True)
def _no_device_errors():
  """Every test also fails on any error a kernel recorded (a timed-out wait, a rank mismatch)."""
  _runtime.check_errors()
  yield
  _runtime.check_errors()


def _per_rank(body):
  """Each rank's own copy of the op's result, stacked on a new leading axis: the copies leave
  the shard_map as they are, so the test sees every rank's bits."""
  def stacked(x, w):
    return _common.mark_varying(body(x, w), {"tp"})[None]
  return stacked


def _ar_fn(mesh, ndim, impl="fused", body=None, w_spec=P("tp", None)):
  """Global x [..., M, K] (K sharded), w [K, N] (rows sharded) -> [tp, ..., M, N]: every rank's
  y."""
  lead = [None] * (ndim - 2)
  body = body or (lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", impl=impl))
  return jax.jit(jax.shard_map(_per_rank(body), mesh=mesh,
                               in_specs=(P(*lead, None, "tp"), w_spec), out_specs=P("tp")))


def _check(stacked, want, dtype):
  """Every rank's copy equals rank 0's bit for bit, and rank 0's is within tolerance."""
  stacked = np.asarray(stacked)
  for rank in range(1, stacked.shape[0]):
    np.testing.assert_array_equal(stacked[rank], stacked[0], err_msg=f"rank {rank} vs rank 0")
  assert stacked.dtype == dtype
  assert rel_err(stacked[0], want) <= TOL[dtype]


def _gemm_rs_shapes():
  shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())["gemm_rs"]
  return [pytest.param(m, s["K"], s["N"], id=f"{s['name']}-M{m}") for s in shapes
          for m in (1, 16, 256, 8192)]


@pytest.mark.parametrize("M,K,N", _gemm_rs_shapes())
def test_benchmark_shapes_match_float32_reference(M, K, N):
  """Per device: x [M, K/tp], w [K/tp, N]; decode rows (stream-K) to prefill (chunked push)."""
  mesh = gpu_mesh()
  x, w = operands(M + N, (M, K), (K, N), jnp.bfloat16)
  got = _ar_fn(mesh, 2)(x, w)
  assert got.shape == (mesh.shape["tp"], M, N)
  _check(got, reference(x, w), jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("M,k,N,batch", [
    (200, 256, 512, ()),      # M not a multiple of the 128-row tile
    (1, 64, 64, ()),          # one row
    (300, 264, 136, ()),      # K, N not multiples of the tile
    (7, 96, 40, (2, 3)),      # batch dims
    (512, 128, 256, (4,)),    # batched prefill: pushed whole
])
def test_odd_shapes_and_batch_dims(dtype, M, k, N, batch):
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(M * k + N, batch + (M, k * tp), (k * tp, N), dtype)
  got = _ar_fn(mesh, x.ndim)(x, w)
  assert got.shape == (tp,) + batch + (M, N)
  _check(got, reference(x, w), dtype)


@pytest.mark.parametrize("push", ["whole", "chunked"])
@pytest.mark.parametrize("tile", tuning.AR_TILES)
@pytest.mark.parametrize("M,k,N", [(16, 4096, 8192), (2048, 1024, 4096), (200, 256, 512)])
def test_every_tile_and_push_matches_float32_reference(tile, push, M, k, N):
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(M + k, (M, k * tp), (k * tp, N), jnp.bfloat16)
  body = lambda x, w: fused_calls.matmul_all_reduce(x, w, "tp")  # noqa: E731
  with tuning.override("matmul_all_reduce", tile=tile, push=push):
    got = _ar_fn(mesh, 2, body=body)(x, w)  # traced here, with the override
  _check(got, reference(x, w), jnp.bfloat16)


@pytest.mark.parametrize("M,k,N,batch", [(16, 512, 1024, ()), (1024, 512, 1024, ()),
                                         (7, 96, 40, (2, 3))])
def test_weight_given_transposed_matches_reference(M, k, N, batch):
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(M + k + N, batch + (M, k * tp), (k * tp, N), jnp.bfloat16)
  body = lambda x, wt: fused_calls.matmul_all_reduce(x, wt, "tp", transpose_w=True)  # noqa: E731
  got = _ar_fn(mesh, x.ndim, body=body, w_spec=P(None, "tp"))(x, jnp.asarray(w.T))
  _check(got, reference(x, w), jnp.bfloat16)


def test_back_to_back_calls_with_fresh_data_and_no_host_sync():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  f = jax.jit(jax.shard_map(lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", impl="fused"),
                            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))
  make = jax.jit(lambda i: operands(i, (512, 256 * tp), (256 * tp, 512), jnp.bfloat16))
  check_back_to_back(f, make)


def test_scan_decode_loop():
  """h [M, D], the same on every rank -> h @ W each step, every rank multiplying its slice of
  h's features by its row shard of W (the decode loop of a row layer without sequence
  parallelism); against the same loop in float32 with h rounded to bf16 each step."""
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  d, steps = 1024, 8
  h0, w = operands(21, (16, d), (d, d), jnp.bfloat16)
  k = d // tp

  def body(h, w):
    def step(h, _):
      h_local = lax.dynamic_slice_in_dim(h, lax.axis_index("tp") * k, k, axis=1)
      h = jaxflux.matmul_all_reduce(h_local, w, "tp", impl="fused")
      return h, h
    return lax.scan(step, h, None, length=steps)[1]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P()))
  got = f(h0, w)
  h, want = h0.astype(jnp.float32), []
  for _ in range(steps):
    h = reference(h, w).astype(jnp.bfloat16).astype(jnp.float32)
    want.append(h)
  assert rel_err(got, jnp.stack(want)) <= 3e-2


def test_gradients_match_float32_reference():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(11, (256, 128 * tp), (128 * tp, 256), jnp.bfloat16)
  ct = jax.random.normal(jax.random.key(12), (256, 256), jnp.float32)
  f = jax.shard_map(lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", impl="fused"),
                    mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())
  dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct),
                            argnums=(0, 1)))(x, w)
  check_matmul_grads(dx, dw, x, w, ct)


def test_compiled_hlo_has_the_custom_call_and_no_all_reduce():
  mesh = gpu_mesh()
  tp = mesh.shape["tp"]
  x, w = operands(13, (256, 128 * tp), (128 * tp, 256), jnp.bfloat16)
  text = _ar_fn(mesh, 2).lower(x, w).compile().as_text()
  assert any(t.startswith(TARGET) for t in hlo_util.custom_call_targets(text))
  assert hlo_util.count_collectives(text).get("all-reduce", 0) == 0


def test_a_peer_that_never_signals_times_out_instead_of_hanging():
  mesh = gpu_mesh()
  jaxflux.configure(timeout_s=2.0)
  try:
    x, w = operands(17, (256, 128 * mesh.shape["tp"]), (128 * mesh.shape["tp"], 256),
                    jnp.bfloat16)
    good = _ar_fn(mesh, 2)
    hang = _ar_fn(mesh, 2, body=lambda x, w: fused_calls.matmul_all_reduce(x, w, "tp",
                                                                      debug_skip_rank=0))
    good(x, w).block_until_ready()
    start = time.monotonic()
    hang(x, w).block_until_ready()
    assert time.monotonic() - start < 15.0
    with pytest.raises(RuntimeError, match=r"matmul_all_reduce: rank 1 .* timed out .* rank 0"):
      _runtime.check_errors()
    _check(good(x, w), reference(x, w), jnp.bfloat16)
  finally:
    jaxflux.configure(timeout_s=30.0)
    _runtime.check_errors()
