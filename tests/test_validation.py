"""Bad input fails at trace time with ValueError/TypeError naming the argument and the fix."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import make_mesh

OPS = {"ag": jaxflux.all_gather_matmul, "rs": jaxflux.matmul_reduce_scatter}


def trace(op, x, w, axis="tp", tp=2, **kw):
  """Runs op inside a shard_map over a 1-D 'tp' mesh, replicated inputs (shapes stay per-device)."""
  mesh = make_mesh((tp,), ("tp",))
  body = lambda x, w: OPS[op](x, w, axis, **kw)  # noqa: E731
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
  return jax.eval_shape(f, x, w)


def arr(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("op", OPS)
def test_x_rank(op):
  with pytest.raises(ValueError, match=r"x must have rank >= 2.*\(16,\)"):
    trace(op, arr((16,)), arr((16, 8)))


@pytest.mark.parametrize("op", OPS)
def test_w_rank(op):
  with pytest.raises(ValueError, match=r"w must have rank 2.*\(16, 8, 2\)"):
    trace(op, arr((4, 16)), arr((16, 8, 2)))


@pytest.mark.parametrize("op", OPS)
def test_k_mismatch(op):
  with pytest.raises(ValueError, match=r"contraction sizes differ: x has K=16.*w has K=12"):
    trace(op, arr((4, 16)), arr((12, 8)))


def test_tokens_not_divisible_by_tp():
  with pytest.raises(ValueError, match=r"token axis of x .*size 5.*tp=2.*Pad the tokens"):
    trace("rs", arr((5, 16)), arr((16, 8)))


@pytest.mark.parametrize("op", OPS)
def test_unknown_axis_name_inside_shard_map(op):
  with pytest.raises(ValueError, match=r"unknown axis_name='model'.*shard_map"):
    trace(op, arr((4, 16)), arr((16, 8)), axis="model")


@pytest.mark.parametrize("op", OPS)
def test_outside_shard_map(op):
  with pytest.raises(ValueError, match=r"unknown axis_name='tp'"):
    OPS[op](jnp.ones((4, 16)), jnp.ones((16, 8)), "tp")


@pytest.mark.parametrize("op", OPS)
def test_integer_dtype(op):
  with pytest.raises(TypeError, match=r"x must be a floating-point array; got dtype int32"):
    trace(op, arr((4, 16), jnp.int32), arr((16, 8)))


@pytest.mark.parametrize("op", OPS)
def test_unknown_impl(op):
  with pytest.raises(ValueError, match=r"impl='cuda' is not one of"):
    trace(op, arr((4, 16)), arr((16, 8)), impl="cuda")


@pytest.mark.parametrize("op", OPS)
def test_fused_rejects_float32(op):
  with pytest.raises(TypeError, match=r"impl='fused'.*x.dtype=float32 is not supported.*bfloat16"):
    trace(op, arr((4, 16)), arr((16, 8)), impl="fused")


@pytest.mark.parametrize("op", OPS)
def test_fused_rejects_mixed_dtypes(op):
  with pytest.raises(TypeError, match=r"x.dtype=bfloat16 and w.dtype=float16 differ"):
    trace(op, arr((4, 16), jnp.bfloat16), arr((16, 8), jnp.float16), impl="fused")


@pytest.mark.skipif(jaxflux.has_cuda(), reason="checks the no-GPU error")
@pytest.mark.parametrize("op", OPS)
def test_fused_without_gpu_raises_not_falls_back(op):
  with pytest.raises(jaxflux.FusedKernelUnavailableError, match=r"impl='fused'.*impl='auto'"):
    trace(op, arr((4, 16), jnp.bfloat16), arr((16, 8), jnp.bfloat16), impl="fused")


def test_auto_runs_reference_on_cpu():
  mesh = make_mesh((2,), ("tp",))
  x = np.asarray(jax.random.normal(jax.random.key(0), (8, 16)), np.float32)
  w = np.asarray(jax.random.normal(jax.random.key(1), (16, 8)), np.float32)
  f = jax.jit(jax.shard_map(functools.partial(jaxflux.all_gather_matmul, axis_name="tp", impl="auto"),
                            mesh=mesh, in_specs=(P("tp", None), P(None, "tp")),
                            out_specs=P(None, "tp")))
  np.testing.assert_allclose(f(x, w), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_configure_validates():
  with pytest.raises(ValueError, match="timeout_s"):
    jaxflux.configure(timeout_s=0)
  with pytest.raises(ValueError, match="workspace_bytes"):
    jaxflux.configure(workspace_bytes=-1)
