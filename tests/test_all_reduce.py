"""GEMM+AllReduce (jaxflux.matmul_all_reduce) on CPU, the pure-JAX path: values against float64
NumPy on the gemm_rs shape families scaled down, odd shapes and batch dims; gradients against
jax.grad of a plain `lax.psum(x @ w)` in the same shard_map and against float64 NumPy; calls back
to back, in lax.fori_loop and lax.scan; the compiled collectives; the argument checks."""
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxflux
from conftest import make_mesh
from jaxpr_util import equations
from hlo_util import count_collectives

ROOT = pathlib.Path(__file__).resolve().parents[1]
TPS = (2, 4, 8)
SOME_TPS = (2, 8)  # for the larger matrices of cases (CPU time)
SCALE = 256  # the real shapes are too big for CPU: K and N divided by this


def _families():
  shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())["gemm_rs"]
  return [pytest.param(s["K"] // SCALE, s["N"] // SCALE, id=s["name"]) for s in shapes]


FAMILIES = _families()


def rand(key, shape, dtype=np.float32):
  return np.asarray(jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def f64(a):
  return np.asarray(a, np.float64)


def lead(nbatch):
  return (None,) * nbatch


def ar_fn(mesh, nbatch, body=None, w_spec=P("tp", None), x_spec=None, **kw):
  """Global view: x [..., M, K] with K sharded, w [K, N] with rows sharded -> y [..., M, N]
  replicated. out_specs names no mesh axis, so the op's result must be typed invariant over tp
  (shard_map checks it)."""
  body = body or (lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", **kw))
  x_spec = P(*lead(nbatch), None, "tp") if x_spec is None else x_spec
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=P()))


def psum_reference(x, w):
  """The same per-device product summed by lax.psum, differentiated by JAX itself."""
  return lax.psum(jnp.matmul(x, w), "tp")


def grads(f, x, w, r):
  return jax.grad(lambda x, w: jnp.sum(f(x, w) * r), argnums=(0, 1))(x, w)


def ref_grads(x, w, r):
  """d/dx, d/dw of sum(r * (x @ w)) for x [..., M, K], in float64."""
  k, n = x.shape[-1], r.shape[-1]
  return f64(r) @ f64(w).T, f64(x).reshape(-1, k).T @ f64(r).reshape(-1, n)


# --- values and gradients ---------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("k,n", FAMILIES)
@pytest.mark.parametrize("tp,impl", [(2, "xla"), (8, "xla"), (4, "auto")])
def test_shape_families_match_float64_reference(tp, impl, k, n, m):
  mesh = make_mesh((tp,), ("tp",))
  x, w = rand(m + k, (m, k)), rand(n + 1, (k, n)) / np.sqrt(k)
  got = ar_fn(mesh, 0, impl=impl)(x, w)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, f64(x) @ f64(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,n", FAMILIES)
@pytest.mark.parametrize("tp", SOME_TPS)
def test_gradients_match_jax_grad_of_psum(tp, k, n):
  mesh = make_mesh((tp,), ("tp",))
  x, w, r = rand(1, (16, k)), rand(2, (k, n)), rand(3, (16, n))
  got = grads(ar_fn(mesh, 0), x, w, r)
  want = grads(ar_fn(mesh, 0, body=psum_reference), x, w, r)
  for g, ref_jax, ref_np in zip(got, want, ref_grads(x, w, r)):
    np.testing.assert_allclose(g, ref_jax, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(g, ref_np, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("batch,m,k,n", [
    ((), 3, 24, 5),      # M, N not multiples of 8
    ((), 1, 8, 1),       # one token, one output feature
    ((2,), 4, 16, 8),    # one batch axis
    ((2, 3), 1, 8, 4),   # two batch axes, one token
])
def test_odd_shapes_and_batch_dims(tp, batch, m, k, n):
  mesh = make_mesh((tp,), ("tp",))
  x, w, r = rand(4, (*batch, m, tp * k)), rand(5, (tp * k, n)), rand(6, (*batch, m, n))
  f = ar_fn(mesh, len(batch))
  got = f(x, w)
  assert got.shape == (*batch, m, n)
  np.testing.assert_allclose(got, f64(x) @ f64(w), rtol=1e-5, atol=1e-4)
  for g, want in zip(grads(f, x, w, r), ref_grads(x, w, r)):
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("replicated", ["x", "w"])
def test_a_replicated_operand_gets_its_cotangent_summed(replicated):
  """x (or w) the same on every device: every device's product uses it, so its gradient sums
  the devices' contributions (the transpose of the implicit broadcast), as jax.grad of the psum
  reference has it."""
  tp = 4
  mesh = make_mesh((tp,), ("tp",))
  if replicated == "x":
    x, w, specs = rand(7, (6, 8)), rand(8, (tp * 8, 5)), dict(x_spec=P(), w_spec=P("tp", None))
  else:
    x, w, specs = rand(7, (6, tp * 8)), rand(8, (8, 5)), dict(x_spec=P(None, "tp"), w_spec=P())
  r = rand(9, (6, 5))
  f, ref = ar_fn(mesh, 0, **specs), ar_fn(mesh, 0, body=psum_reference, **specs)
  np.testing.assert_allclose(f(x, w), ref(x, w), rtol=1e-5, atol=1e-5)
  for g, want in zip(grads(f, x, w, r), grads(ref, x, w, r)):
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-4)
  if replicated == "x":  # the sum over devices of r @ w_iᵀ
    want = sum(f64(r) @ f64(w_i).T for w_i in np.split(w, tp))
    np.testing.assert_allclose(grads(f, x, w, r)[0], want, rtol=1e-5, atol=1e-4)


def test_weight_given_transposed_values_and_grads():
  """transpose_w: w as [N, K] (how a backward hands a forward weight over): the product and
  both gradients, and the backward contracts against w in place (no transpose in the jaxpr)."""
  tp = 2
  mesh = make_mesh((tp,), ("tp",))
  x, w, r = rand(10, (2, 6, tp * 8)), rand(11, (tp * 8, 12)), rand(12, (2, 6, 12))
  body = lambda x, wt: jaxflux.matmul_all_reduce(x, wt, "tp", impl="xla",  # noqa: E731
                                                 transpose_w=True)
  f = ar_fn(mesh, 1, body=body, w_spec=P(None, "tp"))
  wt = np.ascontiguousarray(w.T)
  np.testing.assert_allclose(f(x, wt), f64(x) @ f64(w), rtol=1e-5, atol=1e-4)
  dx, dwt = grads(f, x, wt, r)
  want_dx, want_dw = ref_grads(x, w, r)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dwt, want_dw.T, rtol=1e-5, atol=1e-4)
  for fn, w_arg in ((f, wt), (ar_fn(mesh, 1), w)):
    jaxpr = jax.make_jaxpr(lambda x, w, fn=fn: grads(fn, x, w, r))(x, w_arg)
    assert "transpose" not in _primitives(jaxpr.jaxpr)


@pytest.mark.parametrize("transpose_w", [False, True])
def test_backward_accumulates_dx_in_float32(transpose_w):
  """bf16 operands: the backward's dX dot accumulates in float32 and rounds once (XLA on an
  H200 ran a bf16-typed one-row dX as a GEMV that lost precision where terms cancel)."""
  mesh = make_mesh((2,), ("tp",))
  x = jnp.asarray(rand(70, (1, 32)), jnp.bfloat16)
  w = jnp.asarray(rand(71, (32, 24)), jnp.bfloat16)
  w_arg, w_spec = (w.T, P(None, "tp")) if transpose_w else (w, P("tp", None))
  f = jax.shard_map(lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp", impl="xla",
                                                           transpose_w=transpose_w),
                    mesh=mesh, in_specs=(P(None, "tp"), w_spec), out_specs=P())
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32))))(x, w_arg)
  dots = [e for e in equations(jaxpr) if e.primitive.name == "dot_general"]
  # The forward's dot, then the backward's dX (to x's shape) and dW.
  dx_dots = [e for e in dots if e.outvars[0].aval.shape == (1, 16)]
  assert dx_dots, [e.outvars[0].aval for e in dots]
  assert all(e.params["preferred_element_type"] == jnp.float32 for e in dx_dots), dx_dots


def _primitives(jaxpr) -> set:
  return {eqn.primitive.name for eqn in equations(jaxpr)}


def test_preferred_element_type_and_bf16():
  tp = 2
  mesh = make_mesh((tp,), ("tp",))
  x = rand(13, (8, tp * 16)).astype(jnp.bfloat16)
  w = rand(14, (tp * 16, 8)).astype(jnp.bfloat16)
  f = ar_fn(mesh, 0, preferred_element_type=jnp.float32)
  y = f(x, w)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, f64(x.astype(np.float32)) @ f64(w.astype(np.float32)),
                             rtol=2e-2, atol=2e-2)
  assert ar_fn(mesh, 0)(x, w).dtype == jnp.bfloat16
  dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w)), argnums=(0, 1))(x, w)
  assert dx.dtype == dw.dtype == jnp.bfloat16


def test_float64_gradients_keep_float64_precision():
  mesh = make_mesh((4,), ("tp",))
  with jax.enable_x64(True):
    x, w, r = (rand(i, s, np.float64) for i, s in enumerate([(16, 32), (32, 8), (16, 8)]))
    dx, dw = grads(ar_fn(mesh, 0), x, w, r)
    assert dx.dtype == dw.dtype == jnp.float64
    for g, want in zip((dx, dw), ref_grads(x, w, r)):
      np.testing.assert_allclose(f64(g), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", (2, 4))
def test_second_order_gradients_of_a_local_then_all_reduce_mlp(tp):
  """A column layer without sequence parallelism (a local matmul on replicated tokens) into
  matmul_all_reduce, differentiated twice, against the same function in plain jnp."""
  mesh = make_mesh((tp,), ("tp",))
  x, w1, w2 = rand(30, (6, 8)), rand(31, (8, 3 * tp)) / 3, rand(32, (3 * tp, 8)) / 3

  def body(x, w1, w2):
    return jaxflux.matmul_all_reduce(jnp.tanh(x @ w1), w2, "tp")
  mlp = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp", None)),
                      out_specs=P())
  ref = lambda x, w1, w2: jnp.tanh(x @ w1) @ w2  # noqa: E731

  def outer(f):
    inner = jax.grad(lambda x, w1, w2: jnp.sum(jnp.sin(f(x, w1, w2))), argnums=(0, 1, 2))
    return jax.grad(lambda *a: sum(jnp.sum(g ** 2) for g in inner(*a)), argnums=(0, 1, 2))

  for g, r in zip(jax.jit(outer(mlp))(x, w1, w2), outer(ref)(x, w1, w2)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("direct_linearize", [True, False], ids=["direct", "jvp-partial-eval"])
def test_forward_mode_is_refused_and_eager_reverse_mode_works(direct_linearize):
  """A custom_vjp has reverse mode only: jvp names the op; jax.grad through an eager shard_map
  works with either of JAX's linearizations."""
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(lambda x, w: jaxflux.matmul_all_reduce(x, w, "tp"), mesh=mesh,
                    in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())
  x, w, r = rand(60, (6, 16)), rand(61, (16, 5)), rand(62, (6, 5))
  with pytest.raises(TypeError, match=r"jaxflux\.matmul_all_reduce: can't apply forward-mode "
                                      r"autodiff \(jvp\)"):
    jax.jvp(f, (x, w), (x, w))
  before = jax.config.jax_use_direct_linearize
  jax.config.update("jax_use_direct_linearize", direct_linearize)
  try:
    got = grads(f, x, w, r)
  finally:
    jax.config.update("jax_use_direct_linearize", before)
  for g, want in zip(got, ref_grads(x, w, r)):
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-4)


# --- calls in sequence and in loops -----------------------------------------------------------

def test_back_to_back_calls_with_fresh_data():
  """Several calls queued before any result is read, and two calls chained in one program."""
  tp = 4
  mesh = make_mesh((tp,), ("tp",))
  f = ar_fn(mesh, 0)
  inputs = [(rand(100 + i, (16, tp * 8)), rand(200 + i, (tp * 8, 8))) for i in range(6)]
  outs = [f(x, w) for x, w in inputs]
  for (x, w), y in zip(inputs, outs):
    np.testing.assert_allclose(y, f64(x) @ f64(w), rtol=1e-5, atol=1e-4)

  def chained(x, w1, w2):
    y = jaxflux.matmul_all_reduce(x, w1, "tp")  # [M, tp*8], the same on every device
    y_local = lax.dynamic_slice_in_dim(y, lax.axis_index("tp") * 8, 8, axis=1)
    return jaxflux.matmul_all_reduce(y_local, w2, "tp")
  g = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None),
                                                          P("tp", None)), out_specs=P()))
  x, w1, w2 = rand(40, (16, tp * 8)), rand(41, (tp * 8, tp * 8)), rand(42, (tp * 8, 8))
  np.testing.assert_allclose(g(x, w1, w2), f64(x) @ f64(w1) @ f64(w2), rtol=1e-5, atol=1e-3)


def _decode_step(w):
  """h [M, D] (the same on every device) -> tanh(h @ W): each device multiplies its slice of
  h's features by its row shard of W."""
  def step(h):
    k = w.shape[0]
    h_local = lax.dynamic_slice_in_dim(h, lax.axis_index("tp") * k, k, axis=1)
    return jnp.tanh(jaxflux.matmul_all_reduce(h_local, w, "tp"))
  return step


def _reference_decode(h, w, steps):
  h, w, outs = f64(h), f64(w), []
  for _ in range(steps):
    h = np.tanh(h @ w)
    outs.append(h)
  return np.stack(outs)


@pytest.mark.parametrize("loop", ["fori_loop", "scan"])
def test_inside_loops(loop):
  tp, d, steps = 4, 32, 5
  mesh = make_mesh((tp,), ("tp",))
  h0, w = rand(50, (2, d)), rand(51, (d, d)) / np.sqrt(d)

  def body(h, w):
    step = _decode_step(w)
    if loop == "fori_loop":
      return lax.fori_loop(0, steps, lambda _, h: step(h), h)[None]
    return lax.scan(lambda h, _: (step(h),) * 2, h, None, length=steps)[1]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P()))
  want = _reference_decode(h0, w, steps)
  np.testing.assert_allclose(f(h0, w), want if loop == "scan" else want[-1:], rtol=1e-5,
                             atol=1e-5)
  if loop == "scan":  # gradients through the loop, against the same loop over lax.psum
    def ref_body(h, w):
      k = w.shape[0]
      def step(h, _):
        h_local = lax.dynamic_slice_in_dim(h, lax.axis_index("tp") * k, k, axis=1)
        h = jnp.tanh(lax.psum(h_local @ w, "tp"))
        return h, h
      return lax.scan(step, h, None, length=steps)[1]
    ref = jax.jit(jax.shard_map(ref_body, mesh=mesh, in_specs=(P(), P("tp", None)),
                                out_specs=P()))
    r = rand(52, want.shape)
    for g, want_g in zip(grads(f, h0, w, r), grads(ref, h0, w, r)):
      np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-5)


# --- compiled collectives ---------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["xla", "auto"])
def test_forward_is_one_all_reduce_and_backward_communicates_nothing(impl):
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(functools.partial(jaxflux.matmul_all_reduce, axis_name="tp", impl=impl),
                    mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P())
  x, w, r = jnp.ones((32, 16)), jnp.ones((16, 24)), jnp.ones((32, 24))
  text = jax.jit(f).lower(x, w).compile().as_text()
  assert count_collectives(text) == {"all-reduce": 1}
  grad = jax.value_and_grad(lambda x, w, r: jnp.sum(f(x, w) * r), argnums=(0, 1))
  # The forward's all-reduce only: dX and dW are local products of the whole dY.
  assert count_collectives(jax.jit(grad).lower(x, w, r).compile().as_text()) == {"all-reduce": 1}


# --- argument checks --------------------------------------------------------------------------

def trace(x, w, axis="tp", tp=2, **kw):
  """Traces the op inside a shard_map over a 1-D 'tp' mesh (per-device shapes as given)."""
  mesh = make_mesh((tp,), ("tp",))
  body = lambda x, w: jaxflux.matmul_all_reduce(x, w, axis, **kw)  # noqa: E731
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
  return jax.eval_shape(f, x, w)


def arr(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("x_shape,w_shape,kw,error,match", [
    ((16,), (16, 8), {}, ValueError, r"matmul_all_reduce: x must have rank >= 2.*\(16,\)"),
    ((4, 16), (16, 8, 2), {}, ValueError, r"w must have rank 2.*\(16, 8, 2\)"),
    ((4, 16), (12, 8), {}, ValueError, r"contraction sizes differ: x has K=16.*w has K=12.*"
                                       r"Pass w as \[K, N\]"),
    ((4, 16), (16, 8), {"impl": "cuda"}, ValueError, r"impl='cuda' is not one of"),
    ((4, 16), (16, 8), {"axis": "model"}, ValueError, r"unknown axis_name='model'.*shard_map"),
    ((4, 16), (16, 8), {"axis": ("tp",)}, TypeError, r"axis_name must be a single mesh axis"),
])
def test_bad_arguments_fail_at_trace_time(x_shape, w_shape, kw, error, match):
  with pytest.raises(error, match=match):
    trace(arr(x_shape), arr(w_shape), **kw)


def test_integer_dtype_and_outside_shard_map():
  with pytest.raises(TypeError, match=r"x must be a floating-point array; got dtype int32"):
    trace(arr((4, 16), jnp.int32), arr((16, 8)))
  with pytest.raises(ValueError, match=r"matmul_all_reduce: unknown axis_name='tp'"):
    jaxflux.matmul_all_reduce(jnp.ones((4, 16)), jnp.ones((16, 8)), "tp")


@pytest.mark.parametrize("x_dtype,w_dtype,match", [
    (jnp.float32, jnp.float32, r"x.dtype=float32 is not supported.*bfloat16"),
    (jnp.bfloat16, jnp.float16, r"x.dtype=bfloat16 and w.dtype=float16 differ"),
])
def test_fused_rejects_dtypes_it_lacks(x_dtype, w_dtype, match):
  with pytest.raises(TypeError, match=rf"matmul_all_reduce\(impl='fused'\): .*{match}"):
    trace(arr((4, 16), x_dtype), arr((16, 8), w_dtype), impl="fused")


@pytest.mark.skipif(jaxflux.has_cuda(), reason="checks the no-GPU error")
def test_fused_without_gpu_raises_not_falls_back():
  # Without CUDA kernels, or (CI builds them) with kernels but no GPU.
  with pytest.raises(jaxflux.FusedKernelUnavailableError,
                     match=r"matmul_all_reduce\(impl='fused'\): (this jaxflux build has no CUDA "
                           r"kernels|no CUDA GPU is visible).*Use impl='auto' to fall back to XLA"):
    trace(arr((4, 16), jnp.bfloat16), arr((16, 8), jnp.bfloat16), impl="fused")
