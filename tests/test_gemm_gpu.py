"""GEMM-only mode of the fused kernels' GEMM (CUTLASS sm90) against a float32 reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from jaxflux.ops.gemm import gemm
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


