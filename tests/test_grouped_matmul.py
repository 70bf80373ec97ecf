"""grouped_matmul (the XLA path, jax.lax.ragged_dot) against per-group float64 NumPy references:
forward, gradients, jit, shard_map, and the trace-time errors."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from jaxpr_util import equations
from jaxflux import tuning
from jaxflux.ops import FusedKernelUnavailableError, _platform
from jaxflux.ops.grouped_matmul import grouped_matmul

# (M, K, N, group_sizes): empty groups, all rows in one group, a sum below M (trailing rows
# zero), G=1, no rows at all, odd sizes.
CASES = [
    (13, 7, 5, (3, 0, 6, 4)),
    (9, 5, 3, (9, 0, 0)),
    (9, 5, 3, (0, 0, 9)),
    (11, 6, 7, (2, 3, 1)),
    (7, 3, 5, (7,)),
    (5, 4, 3, (0, 0)),
    (16, 16, 8, (0, 5, 3, 0)),
]


def random_operands(m, k, n, g, dtype=np.float32, w_dtype=None, transpose_w=False, seed=0):
  """Fresh normal data; w laid out [G, N, K] with transpose_w."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  w_shape = (g, n, k) if transpose_w else (g, k, n)
  w = jnp.asarray(rng.standard_normal(w_shape), w_dtype or dtype)
  return x, w


def f64(a):
  return np.asarray(a, np.float64)


def ref_forward(x, w, group_sizes, transpose_w=False):
  """y rows of group g = x rows of group g @ w[g], in float64; rows past the sum stay zero."""
  x, w = f64(x), f64(w)
  if transpose_w:
    w = w.swapaxes(1, 2)
  y = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for g, size in enumerate(group_sizes):
    y[start:start + size] = x[start:start + size] @ w[g]
    start += size
  return y


def ref_grads(x, w, group_sizes, ct, transpose_w=False):
  """Gradients of sum(y * ct): dx rows of group g = ct rows @ w[g]ᵀ, dw[g] = x_gᵀ @ ct_g (zero for
  empty groups and for rows past the sum); dw laid out like w."""
  x, w, ct = f64(x), f64(w), f64(ct)
  if transpose_w:
    w = w.swapaxes(1, 2)
  dx, dw = np.zeros_like(x), np.zeros_like(w)
  start = 0
  for g, size in enumerate(group_sizes):
    rows = slice(start, start + size)
    dx[rows] = ct[rows] @ w[g].T
    dw[g] = x[rows].T @ ct[rows]
    start += size
  return dx, dw.swapaxes(1, 2) if transpose_w else dw


def assert_close(actual, expected, tol):
  """allclose with atol relative to the reference's largest magnitude."""
  expected = f64(expected)
  np.testing.assert_allclose(f64(actual), expected, rtol=tol,
                             atol=tol * max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("impl", ["auto", "xla"])
@pytest.mark.parametrize("m,k,n,group_sizes", CASES)
def test_forward_matches_reference(m, k, n, group_sizes, impl, transpose_w):
  x, w = random_operands(m, k, n, len(group_sizes), transpose_w=transpose_w, seed=m * k + n)
  y = grouped_matmul(x, w, jnp.asarray(group_sizes, jnp.int32), impl=impl,
                     transpose_w=transpose_w)
  assert y.shape == (m, n) and y.dtype == jnp.float32
  assert_close(y, ref_forward(x, w, group_sizes, transpose_w), 1e-5)
  # Rows past the sum are exactly zero, not merely small.
  assert not np.asarray(y[sum(group_sizes):]).any()


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dtypes_with_float32_output(dtype, transpose_w):
  group_sizes = (4, 0, 5, 2)
  x, w = random_operands(13, 9, 7, 4, dtype, transpose_w=transpose_w, seed=1)
  y = grouped_matmul(x, w, jnp.asarray(group_sizes), preferred_element_type=jnp.float32,
                     transpose_w=transpose_w)
  assert y.dtype == jnp.float32
  # Products of 16-bit inputs are exact in float32: only the float32 accumulation rounds.
  assert_close(y, ref_forward(x, w, group_sizes, transpose_w), 1e-5)
  assert not np.asarray(y[11:]).any()


@pytest.mark.parametrize("x_dtype,w_dtype,out_dtype", [
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    (jnp.float16, jnp.float16, jnp.float16),
    (jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.float16, jnp.float32),  # promoted, unlike ragged_dot's own default
])
def test_default_output_dtype_is_promoted(x_dtype, w_dtype, out_dtype):
  group_sizes = (3, 4)
  x, w = random_operands(8, 6, 5, 2, x_dtype, w_dtype, seed=2)
  y = grouped_matmul(x, w, jnp.asarray(group_sizes))
  assert y.dtype == out_dtype
  assert_close(y, ref_forward(x, w, group_sizes), 1e-2)


@pytest.mark.parametrize("gs_dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.int32, jnp.uint32])
def test_any_integer_group_sizes(gs_dtype):
  group_sizes = (2, 5, 0)
  x, w = random_operands(9, 4, 3, 3, seed=3)
  y = grouped_matmul(x, w, jnp.asarray(group_sizes, gs_dtype))
  assert_close(y, ref_forward(x, w, group_sizes), 1e-5)


def test_group_sizes_as_python_list():
  x, w = random_operands(6, 4, 3, 2, seed=4)
  assert_close(grouped_matmul(x, w, [1, 4]), ref_forward(x, w, (1, 4)), 1e-5)


def test_transpose_w_contracts_in_place():
  x, w = random_operands(8, 6, 5, 2, transpose_w=True, seed=5)
  jaxpr = jax.make_jaxpr(functools.partial(grouped_matmul, transpose_w=True))(
      x, w, jnp.asarray([3, 5]))
  prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  assert "ragged_dot_general" in prims and "transpose" not in prims, prims


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("dtype,out_dtype,tol", [
    (jnp.float32, None, 1e-5),
    (jnp.bfloat16, jnp.float32, 1e-2),  # dx and dw round to bfloat16 once
])
@pytest.mark.parametrize("m,k,n,group_sizes", [CASES[0], CASES[3], CASES[4], CASES[6]])
def test_gradients_match_reference(m, k, n, group_sizes, dtype, out_dtype, tol, transpose_w):
  x, w = random_operands(m, k, n, len(group_sizes), dtype, transpose_w=transpose_w, seed=6)
  ct = jnp.asarray(np.random.default_rng(7).standard_normal((m, n)), jnp.float32)
  gs = jnp.asarray(group_sizes)

  def loss(x, w):
    y = grouped_matmul(x, w, gs, preferred_element_type=out_dtype, transpose_w=transpose_w)
    return jnp.sum(y.astype(jnp.float32) * ct)

  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  assert dx.shape == x.shape and dw.shape == w.shape
  ref_dx, ref_dw = ref_grads(x, w, group_sizes, ct, transpose_w)
  assert_close(dx, ref_dx, tol)
  assert_close(dw, ref_dw, tol)
  assert not np.asarray(dx[sum(group_sizes):]).any()
  for g, size in enumerate(group_sizes):
    if size == 0:
      assert not np.asarray(dw[g]).any()


def test_jit_traces_group_sizes():
  x, w = random_operands(12, 5, 6, 3, seed=8)
  traces = []

  @jax.jit
  def f(x, w, gs):
    traces.append(None)
    return grouped_matmul(x, w, gs)

  # Different sizes, one trace: the values are data, not baked into the program.
  for group_sizes in ((4, 4, 4), (0, 10, 1), (12, 0, 0)):
    y = f(x, w, jnp.asarray(group_sizes, jnp.int32))
    assert_close(y, ref_forward(x, w, group_sizes), 1e-5)
  assert len(traces) == 1


def test_shard_map_experts_per_device():
  """Experts sharded over 'ep': each device multiplies its own rows by its own experts."""
  ep, rows, local_groups, k, n = 4, 10, 3, 7, 5
  mesh = make_mesh((ep,), ("ep",))
  x, w = random_operands(ep * rows, k, n, ep * local_groups, seed=9)
  # Per device: empty groups, sums below the local rows, equal to them, and zero.
  group_sizes = np.array([[3, 0, 6], [10, 0, 0], [1, 2, 3], [0, 0, 0]], np.int32)
  gs = jnp.asarray(group_sizes.reshape(-1))
  ct = jnp.asarray(np.random.default_rng(10).standard_normal((ep * rows, n)), jnp.float32)

  spec = P("ep")
  f = jax.jit(jax.shard_map(grouped_matmul, mesh=mesh, in_specs=(spec, spec, spec),
                            out_specs=spec))
  y = f(x, w, gs)
  loss = lambda x, w: jnp.sum(f(x, w, gs) * ct)  # noqa: E731
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)

  for d in range(ep):
    r, gr = slice(d * rows, (d + 1) * rows), slice(d * local_groups, (d + 1) * local_groups)
    sizes = tuple(group_sizes[d])
    assert_close(y[r], ref_forward(x[r], w[gr], sizes), 1e-5)
    ref_dx, ref_dw = ref_grads(x[r], w[gr], sizes, ct[r])
    assert_close(dx[r], ref_dx, 1e-5)
    assert_close(dw[gr], ref_dw, 1e-5)


# --- errors ----------------------------------------------------------------------------------

def arr(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def re_shape(shape):
  return re.escape(str(tuple(shape)))


def trace(x, w, gs, **kw):
  return jax.eval_shape(functools.partial(grouped_matmul, **kw), x, w, gs)


no_kernel_here = pytest.mark.skipif(
    _platform.platform_reason() is None, reason="the grouped GEMM kernel runs here")


@no_kernel_here
def test_fused_raises_unavailable():
  x, w = random_operands(8, 8, 8, 2, jnp.bfloat16, seed=11)
  with pytest.raises(FusedKernelUnavailableError,
                     match=r"grouped_matmul\(impl='fused'\): .*(CUDA|Hopper)"):
    grouped_matmul(x, w, jnp.asarray([3, 5]), impl="fused")


@no_kernel_here
def test_fused_raises_under_jit():
  with pytest.raises(FusedKernelUnavailableError, match=r"impl='fused'"):
    trace(arr((8, 8), jnp.bfloat16), arr((2, 8, 8), jnp.bfloat16), arr((2,), jnp.int32),
          impl="fused")


# Operands the kernel can't take: impl="fused" says why on any machine; impl="auto" runs XLA.
@pytest.mark.parametrize("x_dtype,w_dtype,out_dtype,k,n,match", [
    (jnp.float32, jnp.float32, None, 8, 8, r"x.dtype=float32: .*bfloat16 or float16"),
    (jnp.bfloat16, jnp.float16, jnp.float32, 8, 8, r"x.dtype=bfloat16 and w.dtype=float16"),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32, 8, 8,
     r"preferred_element_type=float32: the kernel writes its input dtype \(bfloat16\)"),
    (jnp.bfloat16, jnp.bfloat16, None, 12, 8, r"K=12 and N=8 must be multiples of 8"),
    (jnp.float16, jnp.float16, None, 8, 4, r"K=8 and N=4 must be multiples of 8"),
])
def test_fused_refuses_operands_the_kernel_cannot_take(x_dtype, w_dtype, out_dtype, k, n, match):
  x, w = random_operands(10, k, n, 3, x_dtype, w_dtype=w_dtype, seed=12)
  gs = jnp.asarray([4, 0, 6])
  with pytest.raises(FusedKernelUnavailableError, match=r"impl='fused'\): " + match):
    grouped_matmul(x, w, gs, impl="fused", preferred_element_type=out_dtype)
  got = grouped_matmul(x, w, gs, impl="auto", preferred_element_type=out_dtype)
  want = grouped_matmul(x, w, gs, impl="xla", preferred_element_type=out_dtype)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_operand_errors_come_before_the_fused_error():
  with pytest.raises(ValueError, match=r"contraction sizes differ"):
    trace(arr((8, 8)), arr((2, 4, 8)), arr((2,), jnp.int32), impl="fused")


def test_bad_impl():
  with pytest.raises(ValueError, match=r"grouped_matmul: impl='cuda' is not one of "
                                       r"\('auto', 'fused', 'xla'\)"):
    trace(arr((8, 4)), arr((2, 4, 3)), arr((2,), jnp.int32), impl="cuda")


@pytest.mark.parametrize("shape", [(8,), (2, 8, 4)])
def test_x_rank(shape):
  with pytest.raises(ValueError, match=r"x must have rank 2 \(\[M, K\].*got shape "
                                       + re_shape(shape) + r".*reshape"):
    trace(arr(shape), arr((2, 4, 3)), arr((2,), jnp.int32))


def test_w_rank_two_suggests_single_group():
  with pytest.raises(ValueError, match=r"w must have rank 3 \(\[G, K, N\].*got shape \(4, 3\)"
                                       r".*w\[None\]"):
    trace(arr((8, 4)), arr((4, 3)), arr((1,), jnp.int32))


def test_w_rank_four_transposed():
  with pytest.raises(ValueError, match=r"w must have rank 3 \(\[G, N, K\].*\(2, 2, 3, 4\).*Stack"):
    trace(arr((8, 4)), arr((2, 2, 3, 4)), arr((2,), jnp.int32), transpose_w=True)


def test_k_mismatch_hints_transpose_w():
  with pytest.raises(ValueError, match=r"x has K=4 \(x.shape=\(8, 4\)\) but w has K=3 "
                                       r"\(w.shape=\(2, 3, 4\), transpose_w=False\).*"
                                       r"transpose_w=True if it is stored \[G, N, K\]"):
    trace(arr((8, 4)), arr((2, 3, 4)), arr((2,), jnp.int32))


def test_k_mismatch_transposed_hints_transpose_w():
  with pytest.raises(ValueError, match=r"x has K=4 .*but w has K=3 \(w.shape=\(2, 4, 3\), "
                                       r"transpose_w=True\).*pass transpose_w=False"):
    trace(arr((8, 4)), arr((2, 4, 3)), arr((2,), jnp.int32), transpose_w=True)


@pytest.mark.parametrize("group_sizes,match", [
    ([-4, 8, 8, 4], r"group_sizes=\[-4, 8, 8, 4\] has negative row counts"),
    (np.array([8, 8, 8, 0]), r"group_sizes=\[8, 8, 8, 0\] sums to 24, more than x's 20 rows"),
])
def test_known_bad_group_sizes_raise(group_sizes, match):
  """Counts known at trace time are checked (the kernel clamps bad ones, ragged_dot does not);
  traced counts are not (no host read)."""
  x, w = jnp.ones((20, 8)), jnp.ones((4, 8, 16))
  for impl in ("xla", "auto"):
    with pytest.raises(ValueError, match=match):
      grouped_matmul(x, w, group_sizes, impl=impl)
  traced = jax.jit(lambda s: grouped_matmul(x, w, s, impl="xla"))
  assert traced(jnp.asarray(group_sizes, jnp.int32)).shape == (20, 16)


@pytest.mark.parametrize("shape", [(3,), (1,), (2, 1), ()])
def test_group_sizes_shape(shape):
  with pytest.raises(ValueError, match=r"group_sizes must have shape \(G,\) = \(2,\).*got shape "
                                       + re_shape(shape)):
    trace(arr((8, 4)), arr((2, 4, 3)), arr(shape, jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bool_])
def test_group_sizes_dtype(dtype):
  with pytest.raises(TypeError, match=r"group_sizes must have an integer dtype.*"
                                      r"astype\(jnp.int32\)"):
    trace(arr((8, 4)), arr((2, 4, 3)), arr((2,), dtype))


@pytest.mark.parametrize("name", ["x", "w"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.complex64])
def test_operand_dtype(name, dtype):
  x, w = arr((8, 4)), arr((2, 4, 3))
  x, w = (arr(x.shape, dtype), w) if name == "x" else (x, arr(w.shape, dtype))
  with pytest.raises(TypeError, match=rf"{name} must be a floating-point array; got dtype"):
    trace(x, w, arr((2,), jnp.int32))


def test_one_fp8_operand_refused():
  with pytest.raises(TypeError, match=r"x is FP8 and w is not.*quantize w to FP8 as well"):
    trace(arr((8, 4), jnp.float8_e4m3fn), arr((2, 4, 3)), arr((2,), jnp.int32))


# --- FP8 ----------------------------------------------------------------------------------------

def fp8_operands(seed, m, k, n, groups, transpose_w, per_row):
  """e4m3 x [m, k], w ([G, n, k] with transpose_w, else [G, k, n]), float32 scales (per row and
  per expert column, or per tensor), and group sizes summing to less than m (rows past the sum
  and an empty group)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((m, k)) * 2, jnp.float8_e4m3fn)
  w_shape = (groups, n, k) if transpose_w else (groups, k, n)
  w = jnp.asarray(rng.standard_normal(w_shape), jnp.float8_e4m3fn)
  if per_row:
    xs = rng.uniform(0.01, 0.1, (m, 1)).astype(np.float32)
    ws = rng.uniform(0.01, 0.1, (groups, 1, n)).astype(np.float32)
  else:
    xs, ws = np.float32(0.05), np.float32(0.02)
  sizes = rng.multinomial(m - 3, np.ones(groups) / groups).astype(np.int32)
  sizes[1] = 0
  sizes[0] += (m - 3) - sizes.sum()
  return x, w, jnp.asarray(sizes), jnp.asarray(xs), jnp.asarray(ws)


def fp8_reference(x, w, sizes, xs, ws, transpose_w):
  """float64 NumPy, group by group, from the dequantized operands."""
  x64 = np.asarray(x.astype(jnp.float32), np.float64) * np.asarray(xs, np.float64)
  w64 = np.asarray(w.astype(jnp.float32), np.float64)
  if transpose_w:
    w64 = w64.transpose(0, 2, 1)
  w64 = w64 * np.broadcast_to(np.asarray(ws, np.float64), (w64.shape[0], 1, w64.shape[2]))
  y = np.zeros((x.shape[0], w64.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    y[start:start + size] = x64[start:start + size] @ w64[g]
    start += size
  return y


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_matches_dequantized_reference(transpose_w, per_row):
  x, w, sizes, xs, ws = fp8_operands(3, 40, 32, 24, 4, transpose_w, per_row)
  y = jax.jit(lambda *a: grouped_matmul(*a[:3], x_scale=a[3], w_scale=a[4], impl="xla",
                                        transpose_w=transpose_w))(x, w, sizes, xs, ws)
  assert y.dtype == jnp.bfloat16 and y.shape == (40, 24)
  want = fp8_reference(x, w, sizes, xs, ws, transpose_w)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-2, atol=2e-2)
  assert not np.asarray(y[int(sizes.sum()):], np.float32).any()  # rows past the sum


def test_fp8_is_forward_only():
  x, w, sizes, xs, ws = fp8_operands(4, 16, 16, 8, 2, True, False)
  loss = lambda w: jnp.sum(grouped_matmul(  # noqa: E731
      x, w, sizes, x_scale=xs, w_scale=ws, transpose_w=True).astype(jnp.float32))
  with pytest.raises(TypeError, match=r"grouped_matmul: an FP8 call .* is forward-only"):
    jax.grad(loss)(w)


@pytest.mark.parametrize("x_scale,w_scale,error,match", [
    (None, np.float32(1), TypeError, r"x is FP8 \(float8_e4m3fn\) and needs x_scale"),
    (np.float32(1), np.ones((2, 8), np.float32), ValueError,
     r"w_scale has shape \(2, 8\).*\(G, 1, N\), one per output column"),
    (np.ones((16,), np.float32), np.float32(1), ValueError, r"x_scale has shape \(16,\)"),
])
def test_fp8_scale_errors(x_scale, w_scale, error, match):
  x, w, sizes, _, _ = fp8_operands(5, 16, 16, 8, 2, True, False)
  with pytest.raises(error, match=match):
    grouped_matmul(x, w, sizes, x_scale=x_scale, w_scale=w_scale, transpose_w=True)


def test_scale_without_fp8_refused():
  with pytest.raises(TypeError, match=r"x_scale was given, but .* are not FP8"):
    trace(arr((8, 4)), arr((2, 4, 3)), arr((2,), jnp.int32), x_scale=np.float32(1))


@pytest.mark.skipif(_platform.platform_reason() is None, reason="the kernel runs here")
def test_fp8_fused_unavailable_here():
  x, w, sizes, xs, ws = fp8_operands(6, 16, 16, 8, 2, True, False)
  with pytest.raises(FusedKernelUnavailableError, match=r"grouped_matmul\(impl='fused'\)"):
    grouped_matmul(x, w, sizes, x_scale=xs, w_scale=ws, transpose_w=True, impl="fused")


def test_preferred_element_type_not_floating():
  with pytest.raises(TypeError, match=r"preferred_element_type=int32 is not a floating dtype"):
    trace(arr((8, 4)), arr((2, 4, 3)), arr((2,), jnp.int32), preferred_element_type=jnp.int32)


def test_transpose_w_not_bool():
  with pytest.raises(TypeError, match=r"transpose_w must be a Python bool"):
    trace(arr((8, 4)), arr((2, 4, 3)), arr((2,), jnp.int32), transpose_w=1)


def _runs_kernel(f, *args) -> bool:
  return any(eqn.params.get("target_name") == "jaxflux_grouped_gemm"
             for eqn in equations(jax.make_jaxpr(f)(*args)))


def test_auto_is_the_tuning_tables_rule(fake_hopper, monkeypatch):
  # impl="auto" asks the same rule as the dense ops: the grouped GEMM's takes the kernel; FP8
  # has no rule (XLA); without the rule, XLA. impl="fused" runs the kernel either way.
  x, w = random_operands(64, 32, 16, 3, jnp.bfloat16, seed=1)
  gs = jnp.asarray([20, 0, 30], jnp.int32)
  bf16 = lambda impl: lambda x, w: grouped_matmul(x, w, gs, impl=impl)  # noqa: E731
  assert _runs_kernel(bf16("auto"), x, w)
  xq, wq, sizes, xs, ws = fp8_operands(2, 32, 32, 16, 2, True, False)
  fp8 = lambda impl: lambda *a: grouped_matmul(  # noqa: E731
      *a[:3], x_scale=a[3], w_scale=a[4], transpose_w=True, impl=impl)
  assert not _runs_kernel(fp8("auto"), xq, wq, sizes, xs, ws)
  assert _runs_kernel(fp8("fused"), xq, wq, sizes, xs, ws)
  monkeypatch.setattr(tuning, "AUTO_RULES", ())
  assert not _runs_kernel(bf16("auto"), x, w)
  assert _runs_kernel(bf16("fused"), x, w)
