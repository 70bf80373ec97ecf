"""`--op gemm`: the single-device GEMM table.

Each row is one GEMM a device runs inside a fused op at tp=2, timed on one device against XLA's
dot (cuBLAS) on the same operands, variants interleaved as for the other ops:
  ag_gemm rows  [M, K] x [K, N/tp]
    xla           jnp.dot
    gemm_only     gemm(kernel="all_gather_matmul"): the AG+GEMM kernel with its waits off
    cutlass       gemm(kernel="cutlass"): CUTLASS's stock persistent GEMM on the same operands,
                  which tells the fused kernels' own costs apart from CUTLASS's against cuBLAS
  gemm_rs rows  [M, K/tp] x [K/tp, N]
    xla           jnp.dot
    gemm_only     the fused op's GEMM work with communication off: gemm(kernel="cutlass") on the
                  peer's M/2 rows, then gemm(kernel="own_rows", c=that partial) on the own M/2
    cutlass       as for ag_gemm rows, on all M rows
    xla_own_rows  jnp.dot on the own rows [M/2, K/tp] x [K/tp, N] (no C)
    xla_own_rows_c  jnp.dot + C on the same rows (XLA fuses the add into the GEMM)
    own_rows      gemm(kernel="own_rows", c=C) on the same rows: the own-rows kernel reading C
  gemm_ar rows  [M, K/tp] x [K/tp, N] (the gemm_rs shapes; every row on every device)
    xla           jnp.dot
    gemm_only     gemm(kernel="matmul_all_reduce"): the GEMM+AllReduce op's GEMM as it tunes it
    cutlass       as for ag_gemm rows
    streamk       the same with CUTLASS's stream-K 128x128 GEMM
    swap_ab       the same with the swap-AB decode GEMM (tuning.AR_TILES' "swap_ab_streamk")
    and weight_tbps: the rate each variant reads the weight, what bounds it at decode sizes
Each variant's output is checked against the same product computed by XLA in float32.
With an FP8 --dtype the rows are those of fp8_table.py (ag_gemm and gemm_rs, FP8 variants).
With --candidates the rows also time every tuning candidate (tuning_sweep.py).
"""
from __future__ import annotations

import statistics
from typing import Any

import jax.numpy as jnp

from jaxflux import tuning
from jaxflux.bench import fp8_table, tuning_sweep
from jaxflux.bench.config import FP8_DTYPES
from jaxflux.bench.rows import Row
from jaxflux.bench.table import fmt, error_lines

# (numerator, denominator) variants of each ratio a row reports; > 1: jaxflux's kernel is slower.
RATIOS = {"gemm_only_vs_xla": ("gemm_only", "xla"),
          "cutlass_vs_xla": ("cutlass", "xla"),
          "streamk_vs_xla": ("streamk", "xla"),
          "swap_ab_vs_xla": ("swap_ab", "xla"),
          "own_rows_vs_xla_own_rows": ("own_rows", "xla_own_rows"),
          "own_rows_vs_xla_own_rows_c": ("own_rows", "xla_own_rows_c")}
ROW_VARIANTS = {"ag_gemm": ("xla", "gemm_only", "cutlass"),
                "gemm_rs": ("xla", "gemm_only", "cutlass", "xla_own_rows", "xla_own_rows_c",
                            "own_rows"),
                "gemm_ar": ("xla", "gemm_only", "cutlass", "streamk", "swap_ab")}


def row_variants(row: Row) -> tuple[str, ...]:
  """The variants a --op gemm row has, in the order they run."""
  return (fp8_table.ROW_VARIANTS if row.fp8 else ROW_VARIANTS)[row.of]


def _gemm(x, w, **kwargs):
  from jaxflux.ops import gemm as gemm_module  # the CPU-only harness imports without it
  return gemm_module.gemm(x, w, **kwargs)


def _f32_dot(a, b):
  return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                 preferred_element_type=jnp.float32)


def ag_gemm_only(x, w):
  """AllGather+GEMM's GEMM-only mode: its kernel and tile order with the waits off."""
  return _gemm(x, w, kernel="all_gather_matmul")


def rs_gemm_only(x_peer, x_own, w):
  """GEMM+RS's GEMM work at tp=2 without communication: the peer's rows by CUTLASS's persistent
  GEMM, then the own-rows kernel adding that partial in its epilogue."""
  return _gemm(x_own, w, kernel="own_rows", c=_gemm(x_peer, w, kernel="cutlass"))


def all_reduce_gemm_with(tile: str):
  """GEMM+AllReduce's GEMM with `tile` (one of tuning.AR_TILES), whatever the table picks."""

  def run(x, w):
    from jaxflux import tuning
    with tuning.override("matmul_all_reduce", tile=tile):
      return _gemm(x, w, kernel="matmul_all_reduce")

  return run


_AR_TILE_VARIANTS = {"streamk": "cooperative_128x128_streamk", "swap_ab": "swap_ab_streamk"}


def variant_spec(name: str, row: Row):
  """(function, input names, float32 reference function) of a --op gemm variant (on an FP8
  row: a dict of the Variant's fields), or a reason string where the variant does not apply to
  the row."""
  if tuning_sweep.is_candidate(name):
    return _candidate_spec(name, row)
  if row.fp8:
    return fp8_table.variant_spec(name, row)
  if name not in ROW_VARIANTS[row.of]:
    return f"not applicable to {row.of} rows"
  if name == "xla":
    return jnp.dot, ("x", "w"), _f32_dot
  if name == "cutlass":
    return (lambda x, w: _gemm(x, w, kernel="cutlass")), ("x", "w"), _f32_dot
  if name == "xla_own_rows":
    return jnp.dot, ("x_own", "w"), _f32_dot
  if name == "xla_own_rows_c":
    return ((lambda x, w, c: jnp.dot(x, w) + c), ("x_own", "w", "c"),
            lambda x, w, c: _f32_dot(x, w) + c.astype(jnp.float32))
  if name == "own_rows":
    return ((lambda x, w, c: _gemm(x, w, kernel="own_rows", c=c)), ("x_own", "w", "c"),
            lambda x, w, c: _f32_dot(x, w) + c.astype(jnp.float32))
  if row.of == "ag_gemm":
    return ag_gemm_only, ("x", "w"), _f32_dot
  if name in _AR_TILE_VARIANTS:
    return all_reduce_gemm_with(_AR_TILE_VARIANTS[name]), ("x", "w"), _f32_dot
  if row.of == "gemm_ar":
    return (lambda x, w: _gemm(x, w, kernel="matmul_all_reduce")), ("x", "w"), _f32_dot
  if row.tp != 2:
    return f"the GEMM+RS GEMM-only composition is defined at tp=2, not tp={row.tp}"
  return rs_gemm_only, ("x_peer", "x_own", "w"), lambda p, o, w: _f32_dot(p, w) + _f32_dot(o, w)


def _candidate_spec(variant: str, row):
  """(function, input names, float32 reference) of a tuning sweep candidate (tuning_sweep.py;
  an FP8 row's: a dict of the Variant's fields), or a reason string."""
  parsed = tuning_sweep.parse(variant)
  if parsed is None or parsed[0] != row.of:
    return f"not applicable to {row.of} rows"
  of, fields = parsed
  op = tuning_sweep.OPS[of]
  if row.fp8:  # fp8_gemm_only's fields, its function run under the candidate
    spec = fp8_table.variant_spec("fp8_gemm_only", row)
    if isinstance(spec, str):
      return spec
    fn = spec["fn"]

    def run_fp8(*args):
      with tuning.override(op, **fields):
        return fn(*args)

    return {**spec, "fn": run_fp8}

  if of == "ag_gemm":
    def run(x, w):
      with tuning.override(op, **fields):
        return _gemm(x, w, kernel="all_gather_matmul")

    return run, ("x", "w"), _f32_dot

  def run_own(x, w, c):
    with tuning.override(op, **fields):
      return _gemm(x, w, kernel="own_rows", c=c)

  return (run_own, ("x_own", "w", "c"),
          lambda x, w, c: _f32_dot(x, w) + c.astype(jnp.float32))


def _flops(row: Row, variant: str) -> int | None:
  """FLOP of one call: own-rows variants do 1/tp of the local GEMM; the quantizing pass none."""
  full = 2 * row.M * row.K * row.N // row.tp
  if variant == "quantize":
    return None
  own = variant in ("xla_own_rows", "xla_own_rows_c", "own_rows") or (
      row.of == "gemm_rs" and tuning_sweep.is_candidate(variant))
  return full // row.tp if own else full


def _weight_bytes(row: Row) -> int:
  return row.K // row.tp * row.N * row.itemsize


def summarize_gemm_row(row: Row, samples: dict, errors: dict, rel_err: dict, calls: dict,
                       compile_s: dict, n_sets: int) -> dict:
  """The JSON record of one --op gemm row."""
  names = row_variants(row) + tuple(v for v in dict.fromkeys([*samples, *errors])
                                    if tuning_sweep.applies(v, row))
  ms = {v: (statistics.median(samples[v]) if samples.get(v) else None) for v in names}
  for v in names:
    if ms[v] is None and v not in errors:
      errors[v] = "not requested"
  ratios = {}
  for key, (num, den) in RATIOS.items():
    if num in names:
      a, b = ms.get(num), ms.get(den)
      ratios[key] = None if a is None or not b else a / b
  if row.fp8:
    ratios = fp8_table.row_ratios(row, ms)
  return {
      "op": "gemm", "of": row.of, "name": row.name, "M": row.M, "K": row.K, "N": row.N,
      "tp": row.tp, "dtype": row.dtype, "per_device": row.per_device_shapes,
      **({"accumulate": fp8_table.built_accumulate(row.dtype)} if row.fp8 else {}),
      "input_sets": n_sets, "calls_per_run": calls, "compile_and_first_run_s": compile_s,
      "ms": ms, "spread_ms": {v: ([min(samples[v]), max(samples[v])] if samples.get(v) else None)
                              for v in names},
      "samples_ms": {v: s for v, s in samples.items()},
      "tflops": {v: (None if t is None or _flops(row, v) is None else _flops(row, v) / t / 1e9)
                 for v, t in ms.items()},
      **({"weight_tbps": {v: (None if t is None else _weight_bytes(row) / t / 1e9)
                          for v, t in ms.items()}} if row.of == "gemm_ar" else {}),
      **({"quantize_tbps": fp8_table.quantize_tbps(row, ms["quantize"])}
         if "quantize" in ms else {}),
      "ratios": ratios, "rel_err": rel_err, "errors": errors, "warnings": [],
      **({"candidate_ratios": tuning_sweep.row_ratios(row, ms)}
         if any(tuning_sweep.applies(v, row) for v in names) else {}),
  }


def summarize_table(rows: list[dict]) -> dict[str, Any]:
  """Per fused op and ratio: rows measured, mean and worst (largest) ratio, the worst row."""
  out: dict[str, Any] = {}
  for of in ROW_VARIANTS:
    mine = [r for r in rows if r.get("of") == of]
    if not mine:
      continue
    out[of] = {}
    for key in tuple(RATIOS) + fp8_table.RATIO_KEYS:
      pairs = [(r["ratios"][key], f"{r['name']} M={r['M']}") for r in mine
               if r["ratios"].get(key) is not None]
      if key not in mine[0]["ratios"]:
        continue
      worst = max(pairs) if pairs else (None, None)
      out[of][key] = {"rows": len(pairs), "of_rows": len(mine),
                      "mean": statistics.fmean(p[0] for p in pairs) if pairs else None,
                      "worst": worst[0], "worst_row": worst[1]}
    if any(r["dtype"] in FP8_DTYPES for r in mine):
      out[of].update(fp8_table.summarize_rel_err(mine))
  sweep = tuning_sweep.summarize(rows)
  if sweep:
    out["candidates"] = sweep
  return out


def _weight_rates(record: dict) -> str:
  """gemm_ar rows: the weight read rates, TB/s, of XLA's dot and of the GEMM-only mode."""
  tbps = record.get("weight_tbps")
  if not tbps:
    return ""
  rates = ", ".join(f"{v} {fmt(t, '.2f')}" for v, t in tbps.items())
  return f"   weight TB/s: {rates}"


def format_gemm_table(result: dict) -> str:
  if any(r["dtype"] in FP8_DTYPES for r in result["rows"]):
    sweep = result.get("summary", {}).get("candidates")
    return "\n".join([fp8_table.format_table(result)]
                     + (tuning_sweep.format_summary(sweep) if sweep else []))
  lines = [f"{'of':<8}{'name':<14}{'M':>7}{'xla':>9}{'gemm_only':>10}{'ratio':>7}"
           f"{'cutlass':>9}{'ratio':>7}{'xla_own':>9}{'own_rows':>9}{'ratio':>7}"
           "   (ms per call; ratio > 1: slower than cuBLAS)"]
  for r in result["rows"]:
    ms, ratios = r["ms"], r["ratios"]
    lines.append(f"{r['of']:<8}{r['name']:<14}{r['M']:>7}{fmt(ms.get('xla')):>9}"
                 f"{fmt(ms.get('gemm_only')):>10}{fmt(ratios.get('gemm_only_vs_xla')):>7}"
                 f"{fmt(ms.get('cutlass')):>9}{fmt(ratios.get('cutlass_vs_xla')):>7}"
                 f"{fmt(ms.get('xla_own_rows')):>9}{fmt(ms.get('own_rows')):>9}"
                 f"{fmt(ratios.get('own_rows_vs_xla_own_rows')):>7}"
                 + _weight_rates(r))
  for of, stats in result.get("summary", {}).items():
    if of == "candidates":
      lines.extend(tuning_sweep.format_summary(stats))
      continue
    for key, s in stats.items():
      lines.append(f"{of} {key}: mean {fmt(s['mean'])}, worst {fmt(s['worst'])} "
                   f"({s['worst_row'] or '-'}), {s['rows']} of {s['of_rows']} rows")
  lines.extend(error_lines(result["rows"], quiet=lambda e: e == "not requested"
                           or e.startswith("not applicable")))
  return "\n".join(lines)
