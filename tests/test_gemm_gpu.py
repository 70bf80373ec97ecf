"""GEMM-only mode of the fused kernels' GEMM (CUTLASS sm90) against a float32 reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from jaxflux.ops.gemm import gemm, gemm_own_rows
import gpu_util
from gpu_util import TOL, reference, rel_err

# Unscaled w, as these tests always used.
operands = functools.partial(gpu_util.operands, scale_w=False)


@pytest.mark.gpu
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
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("with_c", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("scheduler,schedule", [("fused", "cooperative"), ("fused", "pingpong"),
                                                ("cutlass", "cooperative")])
@pytest.mark.parametrize("x_shape,n", [
    ((2048, 1024), 2048),  # 4 chunks of 512 rows when chunked (tiles swept along N)
    ((1000, 264), 136),    # M, K, N not multiples of the tile
])
def test_own_rows_kernel_alone_matches_float32_reference(dtype, with_c, chunked, scheduler,
                                                         schedule, x_shape, n):
  """GEMM+RS's own-rows kernel with communication off: x @ w + c, or x @ w without a source
  (then C is not read at all: an output left over from D's garbage would fail the check);
  under the fused ops' scheduler (cooperative or ping-pong tiles, the fused op's two), or
  CUTLASS's (the probe of what the scheduler costs)."""
  x, w = gpu_util.operands(2, x_shape, (x_shape[-1], n), dtype)
  c = jax.random.normal(jax.random.key(3), x_shape[:-1] + (n,), jnp.float32).astype(dtype)
  f = jax.jit(functools.partial(gemm_own_rows, chunked=chunked, scheduler=scheduler,
                                schedule=schedule))
  got = f(x, w, c) if with_c else f(x, w)
  want = reference(x, w) + (c.astype(jnp.float32) if with_c else 0.0)
  assert got.shape == x_shape[:-1] + (n,) and got.dtype == dtype
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert rel_err(got, want) <= TOL[dtype]


def test_own_rows_kernel_checks_its_scheduler_at_trace_time():
  x = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"scheduler must be one of \('fused', 'cutlass'\)"):
    jax.eval_shape(functools.partial(gemm_own_rows, scheduler="persistent"), x, w)
  with pytest.raises(ValueError, match=r"schedule must be one of \('cooperative', 'pingpong'\)"):
    jax.eval_shape(functools.partial(gemm_own_rows, schedule="ping-pong"), x, w)
  with pytest.raises(ValueError, match=r"scheduler='cutlass' runs the cooperative schedule only"):
    jax.eval_shape(functools.partial(gemm_own_rows, scheduler="cutlass", schedule="pingpong"),
                   x, w)
  with pytest.raises(ValueError, match=r"scheduler='cutlass' reads the weight N-major only"):
    jax.eval_shape(functools.partial(gemm_own_rows, scheduler="cutlass", transpose_w=True), x,
                   jax.ShapeDtypeStruct((32, 16), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
@pytest.mark.parametrize("x_shape,n", [((2048, 1024), 2048), ((1000, 264), 136)])
def test_own_rows_kernel_alone_reads_a_transposed_weight(dtype, chunked, schedule, x_shape, n):
  """transpose_w: the weight given as [N, K] and read K-major (the fused op's backward of a
  column-parallel layer), with C, in both schedules and both tile orders."""
  x, w = gpu_util.operands(4, x_shape, (x_shape[-1], n), dtype)
  c = jax.random.normal(jax.random.key(5), x_shape[:-1] + (n,), jnp.float32).astype(dtype)
  f = jax.jit(functools.partial(gemm_own_rows, chunked=chunked, schedule=schedule,
                                transpose_w=True))
  got = f(x, jnp.asarray(w.T), c)
  assert got.shape == x_shape[:-1] + (n,) and got.dtype == dtype
  assert rel_err(got, reference(x, w) + c.astype(jnp.float32)) <= TOL[dtype]


def test_own_rows_kernel_checks_c_at_trace_time():
  x = jax.ShapeDtypeStruct((64, 16), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"c must have the output's shape \(64, 32\)"):
    jax.eval_shape(gemm_own_rows, x, w, jax.ShapeDtypeStruct((64, 16), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"K=16 and N=36 must be multiples of 8"):
    jax.eval_shape(gemm_own_rows, x, jax.ShapeDtypeStruct((16, 36), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"K=16 and N=36 must be multiples of 8"):  # [N, K] given
    jax.eval_shape(functools.partial(gemm_own_rows, transpose_w=True), x,
                   jax.ShapeDtypeStruct((36, 16), jnp.bfloat16))


def test_own_rows_variant_names_map_to_the_probe_arguments():
  from jaxflux.ops.gemm import own_rows_variant
  coop = {"scheduler": "fused", "schedule": "cooperative", "transpose_w": False}
  assert own_rows_variant("own_rows") == (False, {"chunked": False, **coop})
  # "_chunked" holds "_c": chunked without C reads no C (sessions 9-10 passed one).
  assert own_rows_variant("own_rows_chunked") == (False, {"chunked": True, **coop})
  assert own_rows_variant("own_rows_c_chunked_cutlass_scheduler") == (
      True, {"chunked": True, "scheduler": "cutlass", "schedule": "cooperative",
             "transpose_w": False})
  assert own_rows_variant("own_rows_c_chunked_pingpong") == (
      True, {"chunked": True, "scheduler": "fused", "schedule": "pingpong", "transpose_w": False})
  assert own_rows_variant("own_rows_c_pingpong_kmajor") == (
      True, {"chunked": False, "scheduler": "fused", "schedule": "pingpong", "transpose_w": True})
  with pytest.raises(ValueError, match="'own_rows_chunked_c' is not one of"):
    own_rows_variant("own_rows_chunked_c")


@pytest.mark.skipif(jaxflux.has_cuda(), reason="checks the no-GPU error")
def test_own_rows_kernel_unavailable_without_gpu():
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match="gemm_own_rows"):
    jax.eval_shape(gemm_own_rows, jax.ShapeDtypeStruct((64, 16), jnp.bfloat16),
                   jax.ShapeDtypeStruct((16, 64), jnp.bfloat16))
