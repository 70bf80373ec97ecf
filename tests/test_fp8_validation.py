"""FP8 calls that can't run fail at trace time with an error naming the argument and the fix:
scales (missing, dtype, shape, without FP8), operand dtypes (mixed, other 1-byte floats),
differentiation (forward-only), and impl="fused" (the platform on CPU; each FP8 kernel condition
with the platform check faked away), for each of the three ops. Also the dispatch: impl="auto"
takes XLA for FP8 but the measured decode rows at tp=1 on an H100, and impl="fused" calls the
fused FP8 entry with normalized scales."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxflux
from jaxflux import _runtime, tuning
from jaxflux.ops import _config, _fused, _platform
from conftest import make_mesh, mesh_of

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
OPS = {"ag": jaxflux.all_gather_matmul, "rs": jaxflux.matmul_reduce_scatter,
       "ar": jaxflux.matmul_all_reduce}
NAMES = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter", "ar": "matmul_all_reduce"}
# The XLA path's collective of each op, as a jaxpr primitive (psum: `psum` or `psum_invariant`).
COLLECTIVE = {"ag": "all_gather", "rs": "reduce_scatter", "ar": "psum"}
F32 = jnp.float32


def arr(shape, dtype=E4M3):
  return jax.ShapeDtypeStruct(shape, dtype)


def trace(op, x, w, *, tp=2, **kw):
  """Traces op inside a shard_map over a 1-D 'tp' mesh with replicated operands (the shapes
  given are the per-device ones); scales and other keywords are closed over."""
  mesh = make_mesh((tp,), ("tp",))
  fn = OPS[op] if isinstance(op, str) else op
  f = jax.shard_map(lambda x, w: fn(x, w, "tp", **kw), mesh=mesh, in_specs=(P(), P()),
                    out_specs=P(), check_vma=False)
  return jax.eval_shape(f, x, w)


def ok_scales(x_shape=(4, 32), n=16):
  return {"x_scale": jnp.ones(x_shape[:-1] + (1,), F32), "w_scale": jnp.ones((1, n), F32)}


@pytest.mark.parametrize("op", OPS)
def test_accepted_scale_shapes_trace(op):
  for xs, ws in [((), ()), ((1,), (1,)), ((2, 4, 1), (1, 16)), ((1,), (1, 16))]:
    out = trace(op, arr((2, 4, 32)), arr((32, 16)), x_scale=jnp.ones(xs, F32),
                w_scale=jnp.ones(ws, F32))
    assert out.dtype == jnp.bfloat16
  # transpose_w: w is [N, K]; the column scales follow N = w.shape[0].
  out = trace(op, arr((4, 32)), arr((16, 32)), transpose_w=True, x_scale=jnp.ones((4, 1), F32),
              w_scale=jnp.ones((1, 16), F32))
  assert out.shape[-1] == 16


@pytest.mark.parametrize("missing", ["x_scale", "w_scale"])
@pytest.mark.parametrize("op", OPS)
def test_missing_scale(op, missing):
  kw = ok_scales()
  del kw[missing]
  operand = missing[0]
  with pytest.raises(TypeError, match=rf"{NAMES[op]}: {operand} is FP8 \(float8_e4m3fn\) and "
                     rf"needs {missing}.*float32 array of shape \(\) or \(1,\)"):
    trace(op, arr((4, 32)), arr((32, 16)), **kw)


@pytest.mark.parametrize("op", OPS)
def test_wrong_scale_shapes(op):
  with pytest.raises(ValueError, match=r"x_scale has shape \(4,\).*\(\) or \(1,\) \(one scale for "
                     r"x\) or \(4, 1\) = x.shape\[:-1\] \+ \(1,\)"):
    trace(op, arr((4, 32)), arr((32, 16)), x_scale=jnp.ones((4,), F32),
          w_scale=jnp.ones((1,), F32))
  with pytest.raises(ValueError, match=r"w_scale has shape \(16, 1\).*\(1, 16\) = \(1, N\)"):
    trace(op, arr((4, 32)), arr((32, 16)), x_scale=jnp.ones((), F32),
          w_scale=jnp.ones((16, 1), F32))
  # With transpose_w N is w.shape[0]: (1, 32) = (1, K) is not a column scale.
  with pytest.raises(ValueError, match=r"w_scale has shape \(1, 32\).*N = w.shape\[0\]"):
    trace(op, arr((4, 32)), arr((16, 32)), transpose_w=True, x_scale=jnp.ones((), F32),
          w_scale=jnp.ones((1, 32), F32))


@pytest.mark.parametrize("op", OPS)
def test_scale_dtype_must_be_float32(op):
  with pytest.raises(TypeError, match=r"x_scale.dtype=bfloat16; scales must be float32\. Pass "
                     r"x_scale.astype\(jnp.float32\)"):
    trace(op, arr((4, 32)), arr((32, 16)), x_scale=jnp.ones((), jnp.bfloat16),
          w_scale=jnp.ones((), F32))
  with pytest.raises(TypeError, match=r"w_scale must be a float32 array; got float"):
    trace(op, arr((4, 32)), arr((32, 16)), x_scale=jnp.ones((), F32), w_scale=2.0)


@pytest.mark.parametrize("op", OPS)
def test_mixed_fp8_and_bfloat16(op):
  with pytest.raises(TypeError, match=r"x.dtype=float8_e4m3fn and w.dtype=bfloat16: x is FP8 and "
                     r"w is not.*quantize w to FP8 as well"):
    trace(op, arr((4, 32)), arr((32, 16), jnp.bfloat16), **ok_scales())
  with pytest.raises(TypeError, match=r"w is FP8 and x is not"):
    trace(op, arr((4, 32), jnp.bfloat16), arr((32, 16), E5M2), **ok_scales())


@pytest.mark.parametrize("op", OPS)
def test_scale_without_fp8(op):
  with pytest.raises(TypeError, match=r"x_scale was given, but x.dtype=bfloat16 and "
                     r"w.dtype=bfloat16 are not FP8; scales apply to float8 operands only"):
    trace(op, arr((4, 32), jnp.bfloat16), arr((32, 16), jnp.bfloat16),
          x_scale=jnp.ones((), F32))
  with pytest.raises(TypeError, match=r"w_scale was given.*Drop w_scale"):
    trace(op, arr((4, 32), F32), arr((32, 16), F32), w_scale=jnp.ones((), F32))


@pytest.mark.parametrize("op", OPS)
def test_other_one_byte_floats_are_refused(op):
  with pytest.raises(TypeError, match=r"w.dtype=float8_e4m3fnuz is not an FP8 format jaxflux "
                     r"takes.*float8_e4m3fn and float8_e5m2"):
    trace(op, arr((4, 32)), arr((32, 16), jnp.float8_e4m3fnuz), **ok_scales())


def test_all_reduce_takes_odd_rows_and_a_batch():
  """matmul_all_reduce scatters nothing: any row count, the output [..., M, N] in bfloat16."""
  for x_shape in [(1, 32), (3, 32), (2, 17, 32)]:
    out = trace("ar", arr(x_shape), arr((16, 32)), transpose_w=True,
                **ok_scales(x_shape, 16))
    assert (out.shape, out.dtype) == (x_shape[:-1] + (16,), jnp.bfloat16)


@pytest.mark.parametrize("op", OPS)
def test_static_arguments(op):
  with pytest.raises(TypeError, match=r"transpose_w must be a Python bool.*got 1 of type int"):
    trace(op, arr((4, 32)), arr((32, 16)), transpose_w=1, **ok_scales())
  with pytest.raises(TypeError, match=r"preferred_element_type=int32 is not a floating dtype"):
    trace(op, arr((4, 32)), arr((32, 16)), preferred_element_type=jnp.int32, **ok_scales())
  with pytest.raises(ValueError, match=r"w has K=16 \(w.shape=\(32, 16\), transpose_w=True\)\. "
                     r"With transpose_w=True w is \[N, K\]"):
    trace(op, arr((4, 32), F32), arr((32, 16), F32), transpose_w=True)


# --- forward-only -------------------------------------------------------------------------------

def _fp8_call(op, tp=2):
  """A jitted shard_map of an FP8 call on global float32 x, w (quantized inside), and scales, so
  that it can be differentiated with respect to any of them."""
  mesh = mesh_of((tp,), ("tp",))
  if op == "ag":
    specs, out = (P("tp", None), P(None, "tp")), P(None, "tp")
  else:
    specs, out = (P(None, "tp"), P("tp", None)), (P() if op == "ar" else P("tp", None))

  def body(x, w, xs, ws):
    return OPS[op](x.astype(E4M3), w.astype(E4M3), "tp", x_scale=xs, w_scale=ws,
                   preferred_element_type=F32)

  f = jax.shard_map(body, mesh=mesh, in_specs=specs + (P(), P()), out_specs=out)
  rng = np.random.default_rng(0)
  args = [jnp.asarray(rng.standard_normal(s), F32) for s in ((8, 32), (32, 16))]
  args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  return mesh, f, args + [jnp.float32(0.5), jnp.float32(2.0)]


@pytest.mark.parametrize("argnum", [0, 1, 2], ids=["x", "w", "x_scale"])
@pytest.mark.parametrize("op", OPS)
def test_differentiating_an_fp8_call_names_the_op_and_the_layer_recipe(op, argnum):
  mesh, f, args = _fp8_call(op)
  loss = lambda *a: jnp.sum(f(*a))  # noqa: E731
  with jax.set_mesh(mesh):
    assert jax.jit(f)(*args).dtype == F32  # the forward alone runs
    with pytest.raises(TypeError, match=rf"jaxflux\.{NAMES[op]}: an FP8 call .* is forward-only"
                       r".*jaxflux\.Dense\(\.\.\., tensor_parallel=\.\.\., "
                       r"dot_general_cls=flax\.linen\.Fp8DirectDotGeneralOp\)"):
      jax.jit(jax.grad(loss, argnums=argnum))(*args)


@pytest.mark.parametrize("op", OPS)
def test_forward_mode_is_refused(op):
  mesh, f, args = _fp8_call(op)
  with jax.set_mesh(mesh):
    with pytest.raises(TypeError, match=rf"jaxflux\.{NAMES[op]}: can't apply forward-mode"):
      jax.jvp(lambda xs: f(args[0], args[1], xs, args[3]), (args[2],), (args[2],))


def test_an_enclosing_custom_vjp_may_call_it_in_both_passes():
  """What the layer recipe does: the FP8 op inside another custom_vjp's forward and backward."""
  mesh, f, args = _fp8_call("ag")

  @jax.custom_vjp
  def layer(x, w):
    return f(x, w, jnp.float32(1.0), jnp.float32(1.0))

  def fwd(x, w):
    return layer(x, w), (x, w)

  def bwd(res, g):  # a stand-in backward that itself runs the FP8 op
    x, w = res
    return jnp.zeros_like(x) + jnp.sum(f(x, w, jnp.float32(1.0), jnp.float32(1.0))), w

  layer.defvjp(fwd, bwd)
  with jax.set_mesh(mesh):
    dx = jax.jit(jax.grad(lambda x, w: jnp.sum(layer(x, w))))(args[0], args[1])
  assert dx.shape == args[0].shape and np.isfinite(np.asarray(dx)).all()


# --- impl="fused" and "auto" -------------------------------------------------------------------

@pytest.mark.skipif(jaxflux.has_cuda(), reason="checks the no-GPU error")
@pytest.mark.parametrize("op", OPS)
def test_fused_on_cpu_names_the_platform(op):
  # The reason this machine gives: no CUDA build, or (a CUDA build, as in CI) no GPU.
  reason = re.escape(_platform.platform_reason("tp"))
  with pytest.raises(jaxflux.FusedKernelUnavailableError,
                     match=rf"{NAMES[op]}\(impl='fused'\) with FP8 operands: {reason}.*"
                     r"impl='xla'"):
    trace(op, arr((4, 32)), arr((16, 32)), impl="fused", transpose_w=True, **ok_scales())


@pytest.fixture
def fake_gpu(monkeypatch):
  """The platform check passes, as on a Hopper GPU; nothing is lowered."""
  monkeypatch.setattr(_platform, "platform_reason", lambda axis_name=None: None)


@pytest.mark.parametrize("x_dtype,w_dtype,kw,match", [
    (E4M3, E5M2, {}, r"take \(x float8_e4m3fn, w float8_e4m3fn\) and \(x float8_e5m2, w "
     r"float8_e4m3fn\); got x.dtype=float8_e4m3fn, w.dtype=float8_e5m2"),
    (E5M2, E5M2, {}, r"got x.dtype=float8_e5m2, w.dtype=float8_e5m2"),
    (E4M3, E4M3, {"transpose_w": False}, r"read the weight K-major: pass the weight's transpose, "
     r"w as \[N, K\] \(here \[16, 32\]\), with transpose_w=True"),
    (E4M3, E4M3, {"preferred_element_type": F32}, r"write bfloat16; "
     r"preferred_element_type=float32 is not supported"),
    (E4M3, E4M3, {"k": 40}, r"w shard is \[N, K\] = \[16, 40\]; the FP8 kernels need K and N "
     r"multiples of 16"),
    (E5M2, E4M3, {"n": 24}, r"\[N, K\] = \[24, 32\]"),
])
@pytest.mark.parametrize("op", OPS)
def test_fused_fp8_conditions(fake_gpu, op, x_dtype, w_dtype, kw, match):
  kw = dict(kw)
  k, n = kw.pop("k", 32), kw.pop("n", 16)
  transpose_w = kw.pop("transpose_w", True)
  w_shape = (n, k) if transpose_w else (k, n)
  with pytest.raises(jaxflux.FusedKernelUnavailableError,
                     match=rf"{NAMES[op]}\(impl='fused'\) with FP8 operands: .*{match}"):
    trace(op, arr((4, k), x_dtype), arr(w_shape, w_dtype), impl="fused",
          transpose_w=transpose_w, **ok_scales((4, k), n), **kw)


def test_fused_fp8_group_size_limit():
  reason = _platform.fused_fp8_operand_reason(arr((4, 32)), arr((16, 32)), jnp.bfloat16, 16,
                                              True)
  assert reason is not None and "size 16" in reason and "up to 8" in reason
  assert _platform.fused_fp8_operand_reason(arr((4, 32)), arr((16, 32)), jnp.bfloat16, 8,
                                            True) is None


def test_group_size_cap_is_the_native_runtimes(monkeypatch):
  # Python refuses what the C++ handlers would: the cap is read from the module, not copied.
  class Module:
    max_ranks = 4
  monkeypatch.setattr(_runtime, "_ext", Module)
  assert "up to 4 GPUs" in _platform.group_reason(5)
  assert _platform.group_reason(4) is None


@pytest.mark.parametrize("op", OPS)
def test_auto_takes_xla_for_fp8_even_where_kernels_run(fake_gpu, op):
  mesh = make_mesh((2,), ("tp",))
  f = jax.shard_map(lambda x, w: OPS[op](x, w, "tp", transpose_w=True, **ok_scales((4096, 64))),
                    mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
  text = str(jax.make_jaxpr(f)(arr((4096, 64)), arr((16, 64))))
  assert "jaxflux_" not in text
  assert COLLECTIVE[op] in text


H100 = tuning.Device("NVIDIA H100 80GB HBM3", "9.0", 132)
H200 = tuning.Device("NVIDIA H200", "9.0", 132)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("device,rows,fused", [
    (H100, 1, True), (H100, 128, True), (H100, 129, False), (H200, 16, False), (None, 16, False)])
def test_auto_takes_the_fp8_decode_gemm_at_tp1_where_measured_ahead(fake_gpu, monkeypatch, op,
                                                                    device, rows, fused):
  """The one FP8 rule (tuning/table.py): decode rows at tp=1 on an H100, where the FP8 decode
  GEMM was timed ahead of XLA's FP8 dot. Larger rows, an H200 (not timed) and a GPU without a
  shipped table keep XLA."""
  monkeypatch.setattr(tuning.device, "current", lambda: device)
  monkeypatch.setattr(_runtime, "gemm_workspace_bytes", lambda *args: 1024)
  monkeypatch.setattr(_runtime, "sm_count", lambda: 132)
  mesh = make_mesh((1,), ("tp",))
  f = jax.shard_map(lambda x, w: OPS[op](x, w, "tp", transpose_w=True, **ok_scales((rows, 64))),
                    mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
  text = str(jax.make_jaxpr(f)(arr((rows, 64)), arr((16, 64))))
  assert ("jaxflux_gemm" in text) == fused, text


def test_the_fp8_rule_needs_fp8_operands_and_tp1():
  for op in NAMES.values():
    assert tuning.auto_prefers_fused(op, 1, 16, 64, fp8=True, device=H100)
    # 16-bit: no rule (on the H100 the decode GEMM trails cuBLAS: h100_gemm_decode.json)
    assert not tuning.auto_prefers_fused(op, 1, 16, 64, device=H100)
    assert not tuning.auto_prefers_fused(op, 2, 16, 64, fp8=True, device=H100)
  assert not tuning.auto_prefers_fused("grouped_matmul", 1, 16, 64, fp8=True, device=H100)


@pytest.mark.parametrize("per_tensor", [True, False], ids=["per-tensor", "row-wise"])
@pytest.mark.parametrize("op", OPS)
def test_fused_calls_the_fp8_entry_with_normalized_scales(fake_gpu, monkeypatch, op, per_tensor):
  """impl="fused" hands the fused FP8 entry x, w [N, K], float32 rows [..., rows, 1] and columns
  [1, N] (a per-tensor scale broadcast) and the output dtype; its results come back as the op's."""
  monkeypatch.setattr(_runtime, "ensure_workspace", lambda nbytes: 0)
  seen = {}

  def ag_entry(x, w, rows, cols, axis_name, want_gathered, *, out_dtype, config):
    seen.update(x=x.shape, w=w.shape, rows=(rows.shape, rows.dtype), cols=(cols.shape, cols.dtype),
                out=out_dtype, axis=axis_name, want=want_gathered, config=config)
    y = jnp.zeros(x.shape[:-2] + (2 * x.shape[-2], w.shape[0]), out_dtype)
    return y, (jnp.zeros(x.shape[:-2] + (2 * x.shape[-2], x.shape[-1]), x.dtype)
               if want_gathered else None)

  def rs_entry(x, w, rows, cols, axis_name, *, out_dtype, config):
    seen.update(x=x.shape, w=w.shape, rows=(rows.shape, rows.dtype), cols=(cols.shape, cols.dtype),
                out=out_dtype, axis=axis_name, config=config)
    return jnp.zeros(x.shape[:-2] + (x.shape[-2] // 2, w.shape[0]), out_dtype)

  def ar_entry(x, w, rows, cols, axis_name, *, out_dtype, config):
    seen.update(x=x.shape, w=w.shape, rows=(rows.shape, rows.dtype), cols=(cols.shape, cols.dtype),
                out=out_dtype, axis=axis_name, config=config)
    return jnp.zeros(x.shape[:-1] + (w.shape[0],), out_dtype)

  monkeypatch.setattr(_fused, "all_gather_matmul_fp8", ag_entry, raising=False)
  monkeypatch.setattr(_fused, "matmul_reduce_scatter_fp8", rs_entry, raising=False)
  monkeypatch.setattr(_fused, "matmul_all_reduce_fp8", ar_entry, raising=False)
  scales = ({"x_scale": jnp.ones((1,), F32), "w_scale": jnp.ones((), F32)} if per_tensor
            else ok_scales((2, 8, 64), 32))
  extra = {"return_gathered": True} if op == "ag" else {}
  out = trace(op, arr((2, 8, 64)), arr((32, 64)), impl="fused", transpose_w=True, **scales,
              **extra)
  assert seen["x"] == (2, 8, 64) and seen["w"] == (32, 64) and seen["axis"] == "tp"
  assert seen["rows"] == ((2, 8, 1), F32) and seen["cols"] == ((1, 32), F32)
  # The plan's kernel configuration, chosen once for the op's class.
  choice_types = {"ag": tuning.AllGatherMatmulChoice, "rs": tuning.MatmulReduceScatterChoice,
                  "ar": tuning.MatmulAllReduceChoice}
  assert isinstance(seen["config"], _config.KernelConfig)
  assert isinstance(seen["config"].choice, choice_types[op])
  assert seen["config"].transpose_w  # the FP8 kernels read w K-major
  assert seen["out"] == jnp.bfloat16
  if op == "ag":
    assert seen["want"] is True
    assert out[0].shape == (2, 16, 32) and out[1].dtype == E4M3
  elif op == "ar":
    assert out.shape == (2, 8, 32) and out.dtype == jnp.bfloat16
  else:
    assert out.shape == (2, 4, 32) and out.dtype == jnp.bfloat16
