"""`--op gemm --dtype float8_e4m3fn` (or `float8_e5m2`): the FP8 GEMM-only table.

The rows are gemm_table.py's ag_gemm, gemm_rs and gemm_ar rows (the GEMM one device runs inside
the fused op at tp=2) with FP8 operands: x in the row's dtype (e4m3 as in a forward pass, e5m2 as
the gradient of a backward pass), the weight in e4m3 given as its transpose [N, K] (K-major, the
layout FP8 tensor cores read), a per-tensor scale for each, bfloat16 output:
  xla_fp8_fast          XLA's FP8 GEMM (cuBLASLt) on the same values and scales (`xla_dot`),
                        fast accumulation
  xla_fp8_promoted      the same with promoted accumulation
  fp8_gemm_only         jaxflux.ops.gemm.gemm with the fused op's kernels, accumulating as they
                        are built for x's dtype (the row's `accumulate`), scales as the fused op
                        passes them (per-tensor broadcast to x's rows and the output's columns):
                        ag_gemm rows the AG+GEMM kernel; gemm_rs rows CUTLASS's GEMM on the
                        peer's M/2 rows, then the own-rows kernel adding that bf16 partial (as
                        the bf16 table's gemm_only); gemm_ar rows GEMM+AllReduce's GEMM as it
                        tunes it (the swap-AB decode GEMM up to 128 rows)
  cutlass_fp8_fast      CUTLASS's persistent FP8 GEMM (kernel "cutlass") on all rows, fast
                        accumulation; the one kernel built with both, so the two modes' speed
                        and error compare on one kernel
  cutlass_fp8_promoted  the same with promoted accumulation
  quantize              the layer recipe's quantizing pass: bf16 x [M, K] and w [K, N] to FP8
                        with per-tensor scales from their amax, w written as [N, K]; timed
                        beside the GEMMs, in no ratio but `quantize_vs_fp8_gemm_only`
Every product variant is checked against one float32 product per row of the same FP8 values and
scales (precision HIGHEST): its rel_err is the accumulation's and the bf16 output's error, not
the quantization's.
"""
from __future__ import annotations

import functools
import math
import statistics
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxflux.bench.rows import Row
from jaxflux.bench.table import error_lines, fmt

W_DTYPE = jnp.float8_e4m3fn  # the weight's format, forward and backward
OUT_DTYPE = jnp.bfloat16
PRODUCTS = ("xla_fp8_fast", "xla_fp8_promoted", "fp8_gemm_only", "cutlass_fp8_fast",
            "cutlass_fp8_promoted")
ROW_VARIANTS = {"ag_gemm": PRODUCTS + ("quantize",), "gemm_rs": PRODUCTS + ("quantize",),
                "gemm_ar": PRODUCTS + ("quantize",)}
RATIO_KEYS = ("fp8_gemm_only_vs_xla_fp8", "cutlass_fp8_fast_vs_xla_fp8_fast",
              "cutlass_fp8_promoted_vs_xla_fp8_promoted", "quantize_vs_fp8_gemm_only")
_CONTRACT_LAST = (((1,), (1,)), ((), ()))  # [M, K] x [N, K] -> [M, N]


def _scale(amax, dtype):
  """The per-tensor scale amax / max(dtype) (the largest value lands on the format's largest),
  rounded up to a bfloat16 value, so that it is exact in every variant's arithmetic."""
  s = jnp.maximum(amax.astype(jnp.float32), jnp.finfo(jnp.float32).tiny)
  s = s / float(jnp.finfo(dtype).max) * (1 + 2.0 ** -7)  # one bf16 step up: rounding stays >= s
  return s.astype(jnp.bfloat16).astype(jnp.float32)


def _quantize(a, scale, dtype):
  fmax = float(jnp.finfo(dtype).max)
  return jnp.clip(a.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def quantize_pass(xb, wb, x_dtype):
  """The layer recipe's quantizing pass on one device, per-tensor: the amax of x and of w, their
  scales, x in `x_dtype` and w in e4m3 written as its transpose [N, K] (the layout the FP8
  kernels read). Returns (x8, wt8, x_scale, w_scale), scales float32 of shape (). The scale
  comes from this amax (the recipe's delayed scaling takes it from an amax history that this
  amax joins: the same reads of x and w, then one quantizing write of each)."""
  sx = _scale(jnp.max(jnp.abs(xb)), x_dtype)
  sw = _scale(jnp.max(jnp.abs(wb)), W_DTYPE)
  return _quantize(xb, sx, x_dtype), _quantize(wb, sw, W_DTYPE).T, sx, sw


def timed_quantize(xb, wb, *, x_dtype):
  """quantize_pass as timed: the scales as shape (1,) (Flax's scale variables; a shard_map
  output cannot be 0-d)."""
  x8, wt8, sx, sw = quantize_pass(xb, wb, x_dtype)
  return x8, wt8, sx.reshape(1), sw.reshape(1)


def xla_dot(x8, wt8, sx, sw, *, precision):
  """XLA's FP8 GEMM: one dot of the FP8 arrays themselves contracting both operands' last axis
  (both K-major, as cuBLASLt's FP8 kernels need), in float32, times the product of the two
  scalar scales, rounded to bfloat16. XLA's GEMM rewriter makes this one cuBLASLt FP8 matmul
  with the scale and the bf16 output fused into it. (Dequantizing each operand to bf16 before
  the dot instead ran as a bf16 GEMM on jax 0.11.2, at twice the FP8 GEMM's time.) Precision
  DEFAULT lets cuBLASLt accumulate fast, HIGHEST asks for promoted accumulation. The row
  records the compiled program's custom calls (`<variant>_custom_calls`,
  `<variant>_triton_gemm`) and warns on GPU when it holds no FP8 GEMM."""
  y = lax.dot_general(x8, wt8, _CONTRACT_LAST, precision=precision,
                      preferred_element_type=jnp.float32)
  return (y * (sx * sw)).astype(OUT_DTYPE)


def _gemm(x, wt, *, kernel, x_scale, w_scale, accumulate=None, c=None):
  """jaxflux.ops.gemm.gemm in its FP8 form (weight [N, K], scales as rows and columns)."""
  from jaxflux.ops import gemm as gemm_module  # the CPU-only harness imports without it
  return gemm_module.gemm(x, wt, kernel=kernel, c=c, transpose_w=True, x_scale=x_scale,
                          w_scale=w_scale, out_dtype=OUT_DTYPE, accumulate=accumulate)


def built_accumulate(x_dtype) -> str | None:
  """How the fused FP8 kernels accumulate for x's dtype ("fast" or "promoted"), or None where
  jaxflux.ops.gemm does not say."""
  try:
    from jaxflux.ops import gemm as gemm_module
    return gemm_module.FP8_ACCUMULATE[jnp.dtype(x_dtype).name]
  except (ImportError, AttributeError, KeyError):
    return None


def ar_gemm_only(x8, wt8, x_scale, w_scale):
  """GEMM+AllReduce's FP8 GEMM as the op tunes it for the row's M."""
  return _gemm(x8, wt8, kernel="matmul_all_reduce", x_scale=x_scale, w_scale=w_scale)


def ag_gemm_only(x8, wt8, x_scale, w_scale):
  """AllGather+GEMM's FP8 GEMM-only mode: its kernel and tile order with the waits off."""
  return _gemm(x8, wt8, kernel="all_gather_matmul", x_scale=x_scale, w_scale=w_scale)


def rs_gemm_only(x_peer, x_own, wt8, x_scale_peer, x_scale_own, w_scale):
  """GEMM+RS's FP8 GEMM work at tp=2 without communication: the peer's rows by CUTLASS's GEMM
  (a bf16 partial), then the own-rows kernel adding that partial in its epilogue."""
  partial = _gemm(x_peer, wt8, kernel="cutlass", x_scale=x_scale_peer, w_scale=w_scale)
  return _gemm(x_own, wt8, kernel="own_rows", c=partial, x_scale=x_scale_own, w_scale=w_scale)


def cutlass_gemm(x8, wt8, x_scale, w_scale, *, accumulate):
  """CUTLASS's persistent FP8 GEMM with the accumulation forced."""
  return _gemm(x8, wt8, kernel="cutlass", x_scale=x_scale, w_scale=w_scale,
               accumulate=accumulate)


def product_f32(x8, wt8, x_scale, w_scale):
  """The reference: (x8 · x_scale) @ (wt8 · w_scaleᵀ)ᵀ in float32 at precision HIGHEST, on the
  row's FP8 values (x_scale [M, 1], w_scale [1, N])."""
  a = x8.astype(jnp.float32) * x_scale
  b = wt8.astype(jnp.float32) * w_scale.reshape(-1, 1)
  return lax.dot_general(a, b, _CONTRACT_LAST, precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _peer_plus_own(rows: int):
  """gemm_rs rows: the product of all rows -> peer rows' product + own rows' product."""
  return lambda p: p[:rows] + p[rows:]


def variant_spec(name: str, row: Row):
  """The fields of the Variant `name` on an FP8 row (a dict), or a reason string."""
  if name not in ROW_VARIANTS[row.of]:
    return f"not applicable to FP8 {row.of} rows"
  x_dtype = jnp.dtype(row.dtype)
  if name == "quantize":
    return {"fn": functools.partial(timed_quantize, x_dtype=x_dtype), "inputs": ("xb", "wb")}
  reference = {"reference": product_f32, "reference_inputs": ("x", "wt", "x_scale", "w_scale")}
  all_rows = {"inputs": ("x", "wt", "x_scale", "w_scale"), **reference}
  if name.startswith("xla_fp8"):
    precision = lax.Precision.DEFAULT if name.endswith("_fast") else lax.Precision.HIGHEST
    return {"fn": functools.partial(xla_dot, precision=precision),
            "inputs": ("x", "wt", "sx", "sw"), **reference}
  if name.startswith("cutlass_fp8"):
    return {"fn": functools.partial(cutlass_gemm, accumulate=name.rpartition("_")[2]),
            **all_rows}
  if row.of in ("ag_gemm", "gemm_ar"):
    return {"fn": ag_gemm_only if row.of == "ag_gemm" else ar_gemm_only, **all_rows}
  if row.tp != 2:
    return f"the GEMM+RS GEMM-only composition is defined at tp=2, not tp={row.tp}"
  return {"fn": rs_gemm_only,
          "inputs": ("x_peer", "x_own", "wt", "x_scale_peer", "x_scale_own", "w_scale"),
          "reference_view": _peer_plus_own(row.M - row.M // row.tp), **reference}


def row_ratios(row: Row, ms: dict) -> dict[str, float | None]:
  """The ratios of an FP8 row (config.DEFINITIONS); fp8_gemm_only against XLA's GEMM with the
  accumulation the fused kernels use for x's dtype."""
  acc = built_accumulate(row.dtype)
  pairs = {"fp8_gemm_only_vs_xla_fp8": ("fp8_gemm_only", f"xla_fp8_{acc}" if acc else None),
           "cutlass_fp8_fast_vs_xla_fp8_fast": ("cutlass_fp8_fast", "xla_fp8_fast"),
           "cutlass_fp8_promoted_vs_xla_fp8_promoted": ("cutlass_fp8_promoted",
                                                        "xla_fp8_promoted"),
           "quantize_vs_fp8_gemm_only": ("quantize", "fp8_gemm_only")}
  out = {}
  for key, (num, den) in pairs.items():
    a, b = ms.get(num), ms.get(den)
    out[key] = None if a is None or not b else a / b
  return out


def _local_dims(row: Row) -> tuple[int, int, int]:
  """(rows, K, N) of the per-device GEMM."""
  if row.of == "ag_gemm":
    return row.M, row.K, row.N // row.tp
  return row.M, row.K // row.tp, row.N


@functools.lru_cache(maxsize=16)
def _set_maker(row: Row, sharding: NamedSharding):
  rows, k, n = _local_dims(row)
  x_dtype = jnp.dtype(row.dtype)

  def make(key):
    kx, kw = jax.random.split(key)
    xb = jax.random.normal(kx, (rows, k), jnp.float32).astype(jnp.bfloat16)
    wb = (jax.random.normal(kw, (k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
    x8, wt8, sx, sw = quantize_pass(xb, wb, x_dtype)
    arrays = {"xb": xb, "wb": wb, "x": x8, "wt": wt8, "sx": sx, "sw": sw,
              "x_scale": jnp.full((rows, 1), sx), "w_scale": jnp.full((1, n), sw)}
    if row.of == "gemm_rs":
      h = rows - rows // row.tp
      arrays.update(x_peer=x8[:h], x_own=x8[h:], x_scale_peer=jnp.full((h, 1), sx),
                    x_scale_own=jnp.full((rows - h, 1), sx))
    return arrays

  return jax.jit(make, out_shardings=sharding)


def make_inputs(row: Row, mesh, n_sets: int, base_key) -> list[dict[str, jax.Array]]:
  """Fresh input sets of an FP8 row: standard-normal bf16 x and w (w / sqrt(K)), quantized by
  `quantize_pass` (so the largest magnitude of each lands on its format's largest), on the
  row's one device."""
  make = _set_maker(row, NamedSharding(mesh, P()))
  sets = [make(jax.random.fold_in(base_key, s)) for s in range(n_sets)]
  jax.block_until_ready(sets)
  return sets


def quantize_tbps(row: Row, ms: float | None) -> float | None:
  """The quantizing pass's rate: bf16 x and w read once, FP8 x and wᵀ written once, TB/s."""
  if ms is None:
    return None
  rows, k, n = _local_dims(row)
  return 3 * (rows * k + k * n) / ms / 1e9


def summarize_rel_err(rows: list[dict]) -> dict[str, Any]:
  """Per product variant, the mean and worst rel_err over the rows that have one, in the shape
  of a ratio's summary (`rel_err_<variant>`)."""
  out = {}
  for v in PRODUCTS:
    pairs = [(r["rel_err"][v], f"{r['name']} M={r['M']}") for r in rows if v in r["rel_err"]]
    worst = max(pairs) if pairs else (None, None)
    out[f"rel_err_{v}"] = {"rows": len(pairs), "of_rows": len(rows),
                           "mean": statistics.fmean(p[0] for p in pairs) if pairs else None,
                           "worst": worst[0], "worst_row": worst[1]}
  return out


def format_table(result: dict) -> str:
  """The printed FP8 table: times, the ratios and each product's rel_err."""
  lines = [f"{'of':<8}{'name':<14}{'M':>7}{'acc':>9}{'xla_fast':>9}{'xla_prom':>9}"
           f"{'gemm_only':>10}{'ratio':>7}{'cut_fast':>9}{'ratio':>7}{'cut_prom':>9}{'ratio':>7}"
           f"{'quantize':>9}   rel_err: xla_fast, xla_prom, gemm_only, cut_fast, cut_prom   "
           "(ms per call; ratio > 1: slower than cuBLASLt accumulating alike)"]
  for r in result["rows"]:
    ms, ratios, err = r["ms"], r["ratios"], r["rel_err"]
    lines.append(f"{r['of']:<8}{r['name']:<14}{r['M']:>7}{r.get('accumulate') or '-':>9}"
                 f"{fmt(ms.get('xla_fp8_fast')):>9}{fmt(ms.get('xla_fp8_promoted')):>9}"
                 f"{fmt(ms.get('fp8_gemm_only')):>10}"
                 f"{fmt(ratios.get('fp8_gemm_only_vs_xla_fp8')):>7}"
                 f"{fmt(ms.get('cutlass_fp8_fast')):>9}"
                 f"{fmt(ratios.get('cutlass_fp8_fast_vs_xla_fp8_fast')):>7}"
                 f"{fmt(ms.get('cutlass_fp8_promoted')):>9}"
                 f"{fmt(ratios.get('cutlass_fp8_promoted_vs_xla_fp8_promoted')):>7}"
                 f"{fmt(ms.get('quantize')):>9}   "
                 + ", ".join(fmt(err.get(v), ".1e") for v in PRODUCTS))
  for of, stats in result.get("summary", {}).items():
    if of == "candidates":  # the tuning sweep's (gemm_table.format_gemm_table prints it)
      continue
    for key, s in stats.items():
      spec = ".2e" if key.startswith("rel_err_") else ".3f"
      lines.append(f"{of} {key}: mean {fmt(s['mean'], spec)}, worst {fmt(s['worst'], spec)} "
                   f"({s['worst_row'] or '-'}), {s['rows']} of {s['of_rows']} rows")
  for r in result["rows"]:
    lines.extend(f"warning: {r['name']} M={r['M']}: {w}" for w in r.get("warnings", []))
  lines.extend(error_lines(result["rows"], quiet=lambda e: e == "not requested"
                           or e.startswith("not applicable")))
  return "\n".join(lines)
