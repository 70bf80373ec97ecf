"""`--op grouped_gemm`'s roofline: the least time a row's grouped GEMM can take on this device,
max(2*M*K*N / dense rate, bytes / weight-read rate), bytes = every expert's weight, x and y once,
with both rates measured in the same run (grouped_table.py's docstring says why)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxflux.bench.config import ROOFLINE_RATE_SHAPES, ROOFLINE_VARIANTS
from jaxflux.bench.grouped_table import GroupedRow, bench_row


def measure_rates(mesh: Mesh, args, log=print) -> dict:
  """The roofline's rates on this device, timed as the rows are (the `dense` variant, XLA's
  dot, in the run's dtype): TFLOP/s of one large dense GEMM, and TB/s reading the weight of a
  GEMM of a few rows (ROOFLINE_RATE_SHAPES). A rate that could not be measured is None, with
  the reason in `errors`."""
  shapes = ROOFLINE_RATE_SHAPES["gpu" if jax.default_backend() == "gpu" else "cpu"]
  itemsize = jnp.dtype(args.dtype).itemsize
  rates: dict[str, Any] = {"shapes": {k: list(v) for k, v in shapes.items()}, "ms": {},
                           "errors": {}}
  for kind, (m, k, n) in shapes.items():
    log(f"[bench] roofline rate, {kind}: dense M={m} K={k} N={n}", flush=True)
    row = GroupedRow(f"rate-{kind}", m, k, n, 1, "even", args.dtype, (m,))
    record = bench_row(row, mesh, ["dense"], args, log=log)
    rates["ms"][kind] = record["ms"]["dense"]
    if record["ms"]["dense"] is None:
      rates["errors"][kind] = record["errors"].get("dense", "not measured")
  compute, read = rates["ms"].get("compute"), rates["ms"].get("weight_read")
  m, k, n = shapes["compute"]
  rates["dense_tflops"] = None if compute is None else 2 * m * k * n / compute / 1e9
  m, k, n = shapes["weight_read"]
  rates["weight_read_tbps"] = None if read is None else k * n * itemsize / read / 1e9
  return rates


def roofline(record: dict, rates: dict) -> dict | None:
  """A row's roofline: ms = max(2*M*K*N / dense rate, bytes / weight-read rate), bytes = every
  expert's weight, x and y once; each grouped variant's fraction of it forward, and forward +
  backward against three forwards' roofline. None where a rate is missing."""
  if not rates.get("dense_tflops") or not rates.get("weight_read_tbps"):
    return None
  M, K, N, G = record["M"], record["K"], record["N"], record["experts"]
  nbytes = (G * K * N + M * K + M * N) * jnp.dtype(record["dtype"]).itemsize
  compute_ms = 2 * M * K * N / (rates["dense_tflops"] * 1e9)
  memory_ms = nbytes / (rates["weight_read_tbps"] * 1e9)
  ms, bound = max(compute_ms, memory_ms), ("compute" if compute_ms >= memory_ms else "memory")
  times = record["ms"]
  return {"ms": ms, "bound": bound, "bytes": nbytes,
          "fraction": {v: ms / times[v] for v in ROOFLINE_VARIANTS if times.get(v)},
          "fraction_fwd_bwd": {v: 3 * ms / (times[v] + times[f"{v}_bwd"])
                               for v in ROOFLINE_VARIANTS
                               if times.get(v) and times.get(f"{v}_bwd")}}
