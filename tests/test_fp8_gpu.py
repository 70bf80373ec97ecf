"""The FP8 GEMM-only kernels on one GPU (jaxflux.ops.gemm.gemm with FP8 x and an e4m3 weight
given [N, K]: CUTLASS's persistent GEMM in both accumulations, the AG+GEMM kernel, GEMM+RS's
own-rows kernel and GEMM+AllReduce's GEMM (the swap-AB decode GEMM up to 128 rows) as built) against a float32 reference of the same FP8 values and scales, so
quantization error is not measured, only the kernels' (accumulation, the bf16 output).

Every per-device shape of benchmarks/shapes.json at tp=2 (ag_gemm [M, K] x [K, N/2], gemm_rs
[M, K/2] x [K/2, N]) at M in {1024, 8192}, and odd shapes (M not a multiple of the tile, K and N
not multiples of 128, batched x); x in e4m3 and in e5m2; per-tensor scales (broadcast to rows
and columns, as the fused ops pass them) and row-wise ones (rows and columns of magnitudes
spread over 2^±4, each quantized with its own scale). Each case prints one line,
`FP8GEMM <case>: rel_err <e> (bar <b>)` (visible with -s), and is a record_property of its test.
Skipped unless jaxflux.has_cuda().
"""
import functools
import json
import pathlib
import zlib

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxflux.ops import gemm as gemm_module

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
W_DTYPE = jnp.float8_e4m3fn
SCALE_KINDS = ("tensor", "rowwise")


def bar(accumulate: str, k: int) -> float:
  """The rel_err allowed: the accuracy bar the accumulation was chosen by. Rounding the exact
  product to the bf16 output alone gives ~1.7e-3 on this data. Promoted accumulation (fp32
  partial sums) adds next to nothing: 3e-3. Fast accumulation keeps the running sum in the
  tensor cores' narrower accumulator, whose error grows with K: 6e-3, 3.6x the output's
  rounding and a sixth of what quantizing a normal input to e4m3 costs (~3.6e-2), for every K
  up to the benchmark's 24576. A wrong scale, layout or tile gives ~1."""
  del k  # one bar for every K of the benchmark shapes
  return 3e-3 if accumulate == "promoted" else 6e-3


def _tp2_shapes() -> list:
  """pytest params (M, K, N) of every per-device GEMM at tp=2, M in {1024, 8192}."""
  shapes = json.loads((ROOT / "benchmarks" / "shapes.json").read_text())
  params = []
  for op, per_device in (("ag_gemm", lambda s: (s["K"], s["N"] // 2)),
                         ("gemm_rs", lambda s: (s["K"] // 2, s["N"]))):
    for s in shapes[op]:
      for m in (1024, 8192):
        params.append(pytest.param((m,), *per_device(s), id=f"{op}-{s['name']}-M{m}"))
  return params


@functools.partial(jax.jit, static_argnames=("x_shape", "n", "x_dtype", "kind"))
def _operands(key, *, x_shape, n, x_dtype, kind):
  """Fresh FP8 operands: x [..., M, K] in x_dtype, wt [N, K] in e4m3, and their float32 scales as
  rows [..., M, 1] and columns [1, N]. Normal values (w / sqrt(K), outputs O(1)); row-wise, every
  row of x and column of w first scaled by 2^u, u uniform in [-4, 4], then quantized with its own
  scale, so a scale applied to the wrong row or column shows. Each scale maps the largest
  magnitude it covers onto the format's largest value."""
  k = x_shape[-1]
  kx, kw, kr, kc = jax.random.split(key, 4)
  x = jax.random.normal(kx, x_shape, jnp.float32)
  w = jax.random.normal(kw, (k, n), jnp.float32) / jnp.sqrt(jnp.float32(k))
  if kind == "rowwise":
    x = x * jnp.exp2(jax.random.uniform(kr, x_shape[:-1] + (1,), jnp.float32, -4.0, 4.0))
    w = w * jnp.exp2(jax.random.uniform(kc, (1, n), jnp.float32, -4.0, 4.0))
    x_amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    w_amax = jnp.max(jnp.abs(w), axis=0, keepdims=True)
  else:
    x_amax, w_amax = jnp.max(jnp.abs(x)), jnp.max(jnp.abs(w))

  def quantize(a, amax, dtype):
    fmax = float(jnp.finfo(dtype).max)
    scale = amax / fmax
    return jnp.clip(a / scale, -fmax, fmax).astype(dtype), scale

  x8, x_scale = quantize(x, x_amax, x_dtype)
  w8, w_scale = quantize(w, w_amax, W_DTYPE)
  rows = jnp.broadcast_to(x_scale, x_shape[:-1] + (1,))
  cols = jnp.broadcast_to(w_scale, (1, n))
  return x8, w8.T, rows, cols


@jax.jit
def _reference(x8, wt8, rows, cols):
  """(x8 · rows) @ (wt8 · colsᵀ)ᵀ in float32 at precision HIGHEST, on the same FP8 values."""
  a = x8.astype(jnp.float32) * rows
  b = wt8.astype(jnp.float32) * cols.reshape(-1, 1)
  return lax.dot_general(a, b, (((a.ndim - 1,), (1,)), ((), ())),
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


@jax.jit
def _rel_err(got, want):
  got = got.astype(jnp.float32)
  return jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel())


_gemm = jax.jit(gemm_module.gemm, static_argnames=("kernel", "transpose_w", "out_dtype",
                                                   "accumulate"))


def _check_kernels(name, x_shape, k, n, fmt, record_property):
  """Every kernel (CUTLASS's in both accumulations, the fused ones as built) on fresh operands of
  both scale kinds; prints and records each case, then fails listing every case over its bar."""
  x_dtype = FORMATS[fmt]
  built = gemm_module.FP8_ACCUMULATE[jnp.dtype(x_dtype).name]
  runs = (("cutlass", "fast"), ("cutlass", "promoted"), ("all_gather_matmul", None),
          ("own_rows", None), ("matmul_all_reduce", None))
  failures = []
  for s, kind in enumerate(SCALE_KINDS):
    key = jax.random.key(zlib.crc32(f"{name} {fmt} {kind}".encode()))
    x8, wt8, rows, cols = _operands(key, x_shape=x_shape + (k,), n=n, x_dtype=x_dtype,
                                    kind=kind)
    want = _reference(x8, wt8, rows, cols)
    for kernel, accumulate in runs:
      c = None
      if kernel == "own_rows":  # the own-rows kernel adds a bf16 partial: a random one
        c = jax.random.normal(jax.random.fold_in(key, 7), want.shape).astype(jnp.bfloat16)
      got = _gemm(x8, wt8, kernel=kernel, c=c, transpose_w=True, x_scale=rows, w_scale=cols,
                  out_dtype=jnp.bfloat16, accumulate=accumulate)
      assert got.shape == want.shape and got.dtype == jnp.bfloat16
      err = float(_rel_err(got, want if c is None else want + c.astype(jnp.float32)))
      limit = bar(accumulate or built, k)
      case = (f"{name} x={fmt} scales={kind} kernel={kernel} "
              f"accumulate={accumulate or built}")
      print(f"FP8GEMM {case}: rel_err {err:.3e} (bar {limit:.1e})", flush=True)
      record_property(case, f"{err:.3e}")
      if not err <= limit:  # NaN fails too
        failures.append(f"{case}: {err:.3e} > {limit:.1e}")
      del got, c
    del x8, wt8, rows, cols, want  # the M=8192 operands are large: one case's at a time
  assert not failures, failures


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("x_lead,k,n", _tp2_shapes())
def test_benchmark_shapes_match_float32_reference(x_lead, k, n, fmt, request, record_property):
  _check_kernels(request.node.callspec.id, x_lead, k, n, fmt, record_property)


@pytest.mark.quick_once()  # the quick tier: e4m3 on the last, odd in every way at once
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("x_lead,k,n", [
    pytest.param((1000,), 256, 512, id="M1000", marks=pytest.mark.slow),  # M not a tile multiple
    pytest.param((130,), 1024, 384, id="M130", marks=pytest.mark.slow),  # one tile and two rows
    pytest.param((1000,), 272, 144, id="K272-N144",  # K and N multiples of 16, not of any tile
                 marks=pytest.mark.slow),
    pytest.param((3, 5), 64, 128, id="batch3x5",  # batch dims fold into M = 15, under one tile
                 marks=pytest.mark.slow),
    pytest.param((2, 130), 272, 144, id="batch2x130-K272-N144"),  # batched, M = 260
])
def test_odd_shapes_match_float32_reference(x_lead, k, n, fmt, request, record_property):
  _check_kernels(request.node.callspec.id, x_lead, k, n, fmt, record_property)


@pytest.mark.quick_once()
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("x_lead,k,n", [
    pytest.param((1,), 4096, 1024, id="M1"),  # one token: the 16-token tile, 15 rows of padding
    pytest.param((3,), 272, 144, id="M3-K272-N144", marks=pytest.mark.slow),  # K, N 16s only
    pytest.param((17,), 1024, 512, id="M17", marks=pytest.mark.slow),  # the 32-token tile
    pytest.param((64,), 2048, 1024, id="M64", marks=pytest.mark.slow),  # the 64-token tile
    pytest.param((100,), 1024, 384, id="M100", marks=pytest.mark.slow),  # two 64-token tiles
    pytest.param((2, 5), 512, 256, id="batch2x5", marks=pytest.mark.slow),  # folds into 10 rows
])
def test_decode_rows_match_float32_reference(x_lead, k, n, fmt, request, record_property):
  """Decode rows, where GEMM+AllReduce's GEMM is the swap-AB decode GEMM."""
  _check_kernels(request.node.callspec.id, x_lead, k, n, fmt, record_property)
