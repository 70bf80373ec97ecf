"""A row's JSON record from its timings: medians, spreads, throughput, speedups, overlap."""
from __future__ import annotations

import statistics
from typing import Any

from jaxflux.bench.config import DEFAULT_VARIANTS, DISPLAY_ORDER, FLOOR_BANDWIDTH, OP_VARIANTS
from jaxflux.bench.rows import Row


def ratio(a, b):
  return None if a is None or b is None or b <= 0 else a / b


def overlap(t_gemm, t_comm, t_v):
  if t_gemm is None or t_comm is None or t_v is None or t_comm <= 0:
    return None
  return (t_gemm + t_comm - t_v) / t_comm


def summarize_row(row: Row, requested: list[str], samples: dict, errors: dict, rel_err: dict,
                  calls: dict, compile_s: dict, n_sets: int) -> dict:
  """The JSON record of a row: every variant the op has, null (with a reason) where not run."""
  names = [v for v in DISPLAY_ORDER if v in OP_VARIANTS[row.op] and
           (v in DEFAULT_VARIANTS or v in requested)]
  ms, spread, warnings = {}, {}, []
  for v in names:
    s = samples.get(v)
    ms[v] = statistics.median(s) if s else None
    spread[v] = [min(s), max(s)] if s else None
    if not s and v not in errors:
      errors[v] = "not requested" if v not in requested else "not run"
    floor = _floor_ms(row, v)
    if ms[v] is not None and ms[v] < floor:
      warnings.append(f"{v}: {ms[v]:.4g} ms per call is below the time to move its bytes once at "
                      f"{FLOOR_BANDWIDTH / 1e12:g} TB/s ({floor:.4g} ms): calls were likely "
                      "hoisted or merged; check with --timing dispatch or --chain perturb")
  record: dict[str, Any] = {
      "op": row.op, "name": row.name, "M": row.M, "K": row.K, "N": row.N, "tp": row.tp,
      "dtype": row.dtype, "per_device": row.per_device_shapes,
      "flops_per_device": row.flops_per_device, "comm_bytes_per_device": row.comm_bytes_per_device,
      "input_sets": n_sets, "calls_per_run": calls, "compile_and_first_run_s": compile_s,
      "ms": ms, "spread_ms": spread,
      "samples_ms": {v: s for v, s in samples.items()},
  }
  gemm_like = ("gemm", "gemm_only", "xla", "xla_windowed", "xla_gspmd", "pallas", "jaxflux", "auto")
  if row.op == "all_gather":
    record["gbps"] = {v: (None if t is None else row.comm_bytes_per_device / t / 1e6)
                      for v, t in ms.items()}
  else:
    record["tflops"] = {v: (None if ms.get(v) is None else row.flops_per_device / ms[v] / 1e9)
                        for v in gemm_like if v in ms}
    record["gbps"] = {"comm": (None if ms.get("comm") is None
                               else row.comm_bytes_per_device / ms["comm"] / 1e6)}
  record["speedup_vs_xla"] = ratio(ms.get("xla"), ms.get("jaxflux"))
  if row.op != "all_gather":  # > 1: the fused kernels' GEMM is faster than XLA's dot (cuBLAS)
    record["gemm_only_vs_gemm"] = ratio(ms.get("gemm"), ms.get("gemm_only"))
  record["speedup_vs_xla_all"] = {v: ratio(ms.get("xla"), ms.get(v)) for v in ms
                                  if v not in ("xla", "comm")}
  if row.op != "all_gather":
    eff = {v: overlap(ms.get("gemm"), ms.get("comm"), ms.get(v))
           for v in ("xla", "xla_windowed", "xla_gspmd", "pallas", "jaxflux", "auto") if v in ms}
    record["overlap_efficiency"] = eff.get("jaxflux")
    record["overlap_efficiency_all"] = eff
  record["rel_err"] = rel_err
  record["errors"] = errors
  record["warnings"] = warnings
  return record


def _floor_ms(row: Row, variant: str) -> float:
  """Time to read each input and write each output once per device at FLOOR_BANDWIDTH: no real
  call can beat it, so a faster number means the timing loop was optimized away."""
  m, k, n, M, K, N = row.M // row.tp, row.K // row.tp, row.N // row.tp, row.M, row.K, row.N
  if row.op == "all_gather":
    elements = M * K
  elif variant == "comm":
    elements = M * K if row.op == "ag_gemm" else M * N + m * N
  elif row.op == "ag_gemm":
    elements = (M if variant in ("gemm", "gemm_only") else m) * K + K * n + M * n
  else:
    elements = M * k + k * N + (M if variant in ("gemm", "gemm_only") else m) * N
  return elements * row.itemsize / FLOOR_BANDWIDTH * 1e3
