"""The fused kernels' GEMMs on one GPU (jaxflux.ops.gemm: CUTLASS's persistent and stream-K
GEMMs, the AG+GEMM kernel and GEMM+RS's own-rows kernel, communication off) against a float32
reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from jaxflux import tuning
from jaxflux.ops.gemm import gemm
import gpu_util
from gpu_util import TOL, reference, rel_err

# Unscaled w, as these tests always used.
operands = functools.partial(gpu_util.operands, scale_w=False)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("x_shape,n", [
    ((1024, 256), 512),
    ((1000, 264), 136),       # M not a multiple of the 128-row tile, K/N not of the tile
    ((3, 5, 64), 128),        # batch dims fold into M; M=15 is under one tile
    ((4096, 8192), 3584),     # llama70b-fc1 at M=8192, tp=8 per device: K=8192, N=28672/8
])
def test_matches_float32_reference(dtype, x_shape, n):
  x, w = operands(0, x_shape, (x_shape[-1], n), dtype)
  got = jax.jit(gemm)(x, w)
  assert got.shape == x_shape[:-1] + (n,) and got.dtype == dtype
  assert rel_err(got, reference(x, w)) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.slow
def test_fresh_data_and_bitwise_deterministic():
  f = jax.jit(gemm)
  for seed in range(3):
    x, w = operands(seed, (512, 1024), (1024, 768), jnp.bfloat16)
    first = np.asarray(f(x, w))
    np.testing.assert_array_equal(first, np.asarray(f(x, w)))
    assert rel_err(first, reference(x, w)) <= 1e-2


@pytest.mark.gpu
def test_per_device_inside_shard_map():
  mesh = jax.make_mesh((jax.device_count(),), ("tp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  tp = mesh.devices.size
  x, w = operands(1, (tp * 256, 512), (512, tp * 256), jnp.bfloat16)
  f = jax.jit(jax.shard_map(gemm, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                            out_specs=P("tp", None)))
  got = np.asarray(f(x, w), np.float32)
  want = np.asarray(reference(x, w))
  for i in range(tp):  # device i computed rows block i x columns block i of the product
    block = got[i * 256:(i + 1) * 256]
    assert rel_err(block, want[i * 256:(i + 1) * 256, i * 256:(i + 1) * 256]) <= 1e-2


@pytest.mark.gpu
def test_bad_shapes_fail_at_trace_time():
  x = jax.ShapeDtypeStruct((64, 12), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((12, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"K=12 and N=64 must be multiples of 8"):
    jax.eval_shape(gemm, x, w)
  with pytest.raises(TypeError, match=r"bfloat16 or float16"):
    jax.eval_shape(gemm, jax.ShapeDtypeStruct((64, 16), jnp.float32),
                   jax.ShapeDtypeStruct((16, 64), jnp.float32))


@pytest.mark.skipif(jaxflux.has_cuda(), reason="checks the no-GPU error")
def test_unavailable_without_gpu():
  x = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match="gemm"):
    jax.eval_shape(gemm, x, jax.ShapeDtypeStruct((16, 64), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.quick_once("kernel")
@pytest.mark.parametrize("kernel", ["cutlass", "all_gather_matmul", "own_rows",
                                    "matmul_all_reduce"])
@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("x_shape,n", [((1024, 256), 512), ((3, 5, 64), 128)])
def test_every_kernel_matches_float32_reference(kernel, transpose_w, x_shape, n):
  """Each kernel as tuned from the table, with the weight given [K, N] or [N, K] (read K-major)."""
  x, w = gpu_util.operands(6, x_shape, (x_shape[-1], n), jnp.bfloat16)
  c = jnp.zeros(x_shape[:-1] + (n,), jnp.bfloat16) if kernel == "own_rows" else None
  f = jax.jit(functools.partial(gemm, kernel=kernel, transpose_w=transpose_w))
  got = f(x, jnp.asarray(w.T) if transpose_w else w, c=c)
  assert got.shape == x_shape[:-1] + (n,) and got.dtype == jnp.bfloat16
  assert rel_err(got, reference(x, w)) <= TOL[jnp.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,shape_class", [
    pytest.param(4096, 2048, "few_waves", marks=pytest.mark.slow),
    pytest.param(12288, 2048, "many_waves.wide_bands",  # 6144-row shards, 8 N tiles
                 marks=pytest.mark.slow),
    pytest.param(12288, 2560, "many_waves",  # 10 N tiles: swizzle 8 would pad N
                 marks=pytest.mark.slow),
])
def test_all_gather_gemm_swizzle_classes_match_float32_reference(rows, n, shape_class):
  """The all-gather GEMM as this GPU's tables tune each class (the classes the GEMM-only mode
  picks for shards of rows / 2), against the reference."""
  from jaxflux import _runtime
  tuned = tuning.choose_all_gather_matmul(dtype="bfloat16", tp=2, rows=rows, k=256, n=n,
                                          sms=_runtime.sm_count(), shard_rows=rows // 2)
  assert tuned.shape_class == shape_class
  x, w = gpu_util.operands(rows + n, (rows, 256), (256, n), jnp.bfloat16)
  got = jax.jit(functools.partial(gemm, kernel="all_gather_matmul"))(x, w)
  assert rel_err(got, reference(x, w)) <= TOL[jnp.bfloat16]


def _own_rows(x, w, c, *, push, schedule, transpose_w=False):
  """The own-rows kernel with its tile order (push) and schedule forced, traced right here."""
  with tuning.override("matmul_reduce_scatter", push=push, own_rows_schedule=schedule):
    f = jax.jit(functools.partial(gemm, kernel="own_rows", transpose_w=transpose_w))
    return f(x, w, c=c)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("with_c", [True, False])
@pytest.mark.parametrize("push", ["whole", "chunked"])
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
@pytest.mark.parametrize("x_shape,n", [
    ((2048, 1024), 2048),  # 4 chunks of 512 rows when chunked (tiles swept along N)
    ((1000, 264), 136),    # M, K, N not multiples of the tile
])
def test_own_rows_kernel_alone_matches_float32_reference(dtype, with_c, push, schedule, x_shape,
                                                         n):
  """GEMM+RS's own-rows kernel with communication off: x @ w + c, with a random c or zeros,
  in the fused op's two schedules and both tile orders (CUTLASS's, or swept along N as for a
  chunked push)."""
  x, w = gpu_util.operands(2, x_shape, (x_shape[-1], n), dtype)
  c = jax.random.normal(jax.random.key(3), x_shape[:-1] + (n,), jnp.float32).astype(dtype)
  if not with_c:
    c = jnp.zeros_like(c)
  got = _own_rows(x, w, c, push=push, schedule=schedule)
  want = reference(x, w) + c.astype(jnp.float32)
  assert got.shape == x_shape[:-1] + (n,) and got.dtype == dtype
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert rel_err(got, want) <= TOL[dtype]


def test_own_rows_schedule_is_checked_when_overridden():
  with pytest.raises(ValueError, match=r"own_rows_schedule='ping-pong' is not valid; "
                                       r"own_rows_schedule takes 'cooperative' or 'pingpong'"):
    with tuning.override("matmul_reduce_scatter", own_rows_schedule="ping-pong"):
      pass


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("push", ["whole", "chunked"])
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
@pytest.mark.parametrize("x_shape,n", [((2048, 1024), 2048), ((1000, 264), 136)])
def test_own_rows_kernel_alone_reads_a_transposed_weight(dtype, push, schedule, x_shape, n):
  """transpose_w: the weight given as [N, K] and read K-major (the fused op's backward of a
  column-parallel layer), with C, in both schedules and both tile orders."""
  x, w = gpu_util.operands(4, x_shape, (x_shape[-1], n), dtype)
  c = jax.random.normal(jax.random.key(5), x_shape[:-1] + (n,), jnp.float32).astype(dtype)
  got = _own_rows(x, jnp.asarray(w.T), c, push=push, schedule=schedule, transpose_w=True)
  assert got.shape == x_shape[:-1] + (n,) and got.dtype == dtype
  assert rel_err(got, reference(x, w) + c.astype(jnp.float32)) <= TOL[dtype]


def test_own_rows_kernel_checks_c_at_trace_time():
  x = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)
  own_rows = functools.partial(gemm, kernel="own_rows")
  with pytest.raises(ValueError, match=r"c must have the output's shape \(64, 32\)"):
    jax.eval_shape(lambda x, w, c: own_rows(x, w, c=c), x, w,
                   jax.ShapeDtypeStruct((64, 16), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"kernel='own_rows' computes x @ w \+ c and needs c"):
    jax.eval_shape(own_rows, x, w)
  with pytest.raises(ValueError, match=r"c is read by kernel='own_rows' only"):
    jax.eval_shape(lambda x, w, c: gemm(x, w, c=c), x, w,
                   jax.ShapeDtypeStruct((64, 32), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"K=16 and N=36 must be multiples of 8"):
    jax.eval_shape(lambda x, w, c: own_rows(x, w, c=c), x,
                   jax.ShapeDtypeStruct((16, 36), jnp.bfloat16),
                   jax.ShapeDtypeStruct((64, 36), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"K=16 and N=36 must be multiples of 8"):  # [N, K] given
    jax.eval_shape(lambda x, w, c: own_rows(x, w, c=c, transpose_w=True), x,
                   jax.ShapeDtypeStruct((36, 16), jnp.bfloat16),
                   jax.ShapeDtypeStruct((64, 36), jnp.bfloat16))


@pytest.mark.skipif(jaxflux.has_cuda(), reason="checks the no-GPU error")
def test_own_rows_kernel_unavailable_without_gpu():
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match="gemm\\(kernel='own_rows'\\)"):
    jax.eval_shape(lambda x, w, c: gemm(x, w, kernel="own_rows", c=c),
                   jax.ShapeDtypeStruct((64, 16), jnp.bfloat16),
                   jax.ShapeDtypeStruct((16, 64), jnp.bfloat16),
                   jax.ShapeDtypeStruct((64, 64), jnp.bfloat16))


def _all_reduce_gemm(x, w, *, tile, transpose_w=False):
  """GEMM+AllReduce's GEMM with its tile forced, traced right here."""
  with tuning.override("matmul_all_reduce", tile=tile):
    f = jax.jit(functools.partial(gemm, kernel="matmul_all_reduce", transpose_w=transpose_w))
    return f(x, w)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tile", tuning.AR_TILES)
@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("x_shape,n", [
    ((1, 4096), 8192),       # decode: one token, the weight read is everything
    ((8, 14336), 8192),      # llama70b-fc2 per device at tp=2, a few tokens
    ((128, 2048), 1024),     # one tile row
    ((2, 3, 264), 136),      # batch dims, M, K, N not multiples of the tile
    ((2048, 1024), 2048),
])
def test_all_reduce_gemm_matches_float32_reference(dtype, tile, transpose_w, x_shape, n):
  """Both tiles of GEMM+AllReduce's GEMM (CUTLASS's persistent 128x256 and its stream-K 128x128,
  which splits K across SMs when there are few output tiles), at decode and prefill sizes."""
  x, w = gpu_util.operands(7, x_shape, (x_shape[-1], n), dtype)
  got = _all_reduce_gemm(x, jnp.asarray(w.T) if transpose_w else w, tile=tile,
                         transpose_w=transpose_w)
  assert got.shape == x_shape[:-1] + (n,) and got.dtype == dtype
  assert rel_err(got, reference(x, w)) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.quick_once()
@pytest.mark.parametrize("tile", ["cooperative_128x128_streamk", "swap_ab_streamk"])
def test_stream_k_gemms_are_bitwise_deterministic(tile):
  """Stream-K sums the K splits of a tile in a fixed order (CUTLASS's deterministic reduction),
  so results are the same bits run to run."""
  for seed, shape in ((0, (1, 8192)), (1, (64, 14336)), (2, (17, 4096))):
    x, w = gpu_util.operands(seed, shape, (shape[-1], 4096), jnp.bfloat16)
    first = np.asarray(_all_reduce_gemm(x, w, tile=tile))
    for _ in range(3):
      again = np.asarray(_all_reduce_gemm(x, w, tile=tile))
      np.testing.assert_array_equal(first, again)


def _decode_params():
  """(dtype, transpose_w, m): bf16 at one row and 17 rows N-major, 100 rows K-major (each token
  width and weight layout once) in the quick tier; every other combination slow."""
  quick = {(jnp.bfloat16, False, 1), (jnp.bfloat16, False, 17), (jnp.bfloat16, True, 100)}
  return [pytest.param(dtype, tw, m, marks=() if (dtype, tw, m) in quick else pytest.mark.slow,
                       id=f"{jnp.dtype(dtype).name}-{'kmajor' if tw else 'nmajor'}-M{m}")
          for dtype in (jnp.bfloat16, jnp.float16) for tw in (False, True)
          for m in (1, 3, 16, 17, 33, 64, 100, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,transpose_w,m", _decode_params())
def test_decode_gemm_matches_float32_reference(dtype, transpose_w, m):
  """The swap-AB decode GEMM at each token width (16, 32, 64), row counts padded up to one,
  and past 64 rows in several token tiles; the weight N-major and K-major. Every element is
  checked, not only the norm: a padded row or a column of tokens written to the wrong place
  would show in a few elements."""
  x, w = gpu_util.operands(100 + m, (m, 2048), (2048, 1536), dtype)
  got = _all_reduce_gemm(x, jnp.asarray(w.T) if transpose_w else w, tile="swap_ab_streamk",
                         transpose_w=transpose_w)
  want = np.asarray(reference(x, w))
  assert got.shape == (m, 1536) and got.dtype == dtype
  assert rel_err(got, want) <= TOL[dtype]
  scale = np.abs(want).max()
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=2e-2 * scale)
