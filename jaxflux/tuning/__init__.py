"""Kernel choices of the fused ops: shape classification, table lookup and overrides.

The fused ops ask `choose_all_gather_matmul` / `choose_matmul_reduce_scatter` /
`choose_matmul_all_reduce` once per call, at trace time, and hand the choice to the kernel as FFI
attributes. A choice is built in layers, each replacing fields of the one before:
  1. the sm90 defaults (jaxflux/tuning/table.py): every field, for every sm90 GPU;
  2. the device tables of the GPU it runs on (tables.py): the GEMM's tile, schedule and swizzle
     measured on that device kind, by exact shape or by shape class; a user table written by
     `python -m jaxflux.tune` before the one jaxflux ships for the kind;
  3. an `override` block, for measurement (also of grouped_matmul's tile, "grouped_matmul"):

  with jaxflux.tuning.override("matmul_reduce_scatter", reduce="pass", grid_sms=100):
    f = jax.jit(...)   # jit caches traces: build and trace the function inside the block

`jaxflux.tuning.describe()` says which tables this process uses and why. Overrides live on a
per-thread stack (tracing runs in the calling thread); nested blocks compose, the inner one
winning per field. Every value is checked when the block is entered.
"""
from __future__ import annotations

from jaxflux.tuning import tables
from jaxflux.tuning.chooser import (ARCH, LOCAL, Tuned, all_gather_matmul_class,
                                   choose_all_gather_matmul, choose_matmul_all_reduce,
                                   choose_matmul_reduce_scatter, choose_own_rows_gemm,
                                   choose_tp1_gemm, lookup, matmul_all_reduce_class,
                                   matmul_reduce_scatter_class, override, overrides,
                                   resolve_device)
from jaxflux.tuning.device import Device
from jaxflux.tuning.fields import (AG_TILES, AR_TILES, DTYPES, FIELDS, GROUPED_TILES, OPS,
                                   OVERRIDE_OPS, OWN_ROWS_SCHEDULES, SWIZZLES, TILE_ROWS,
                                   AllGatherMatmulChoice, MatmulAllReduceChoice,
                                   MatmulReduceScatterChoice, check_fields, check_op,
                                   shape_classes)
from jaxflux.tuning.grouped import choose_grouped_matmul
from jaxflux.tuning.table import AUTO_RULES, ENTRIES, AutoRule, Entry
from jaxflux.tuning.tables import reload

__all__ = ["AG_TILES", "AR_TILES", "AUTO_RULES", "DTYPES", "ENTRIES", "FIELDS", "GROUPED_TILES",
           "LOCAL", "OPS", "OVERRIDE_OPS", "OWN_ROWS_SCHEDULES", "SWIZZLES", "TILE_ROWS",
           "AllGatherMatmulChoice", "AutoRule", "Device", "Entry", "MatmulAllReduceChoice",
           "MatmulReduceScatterChoice", "Tuned", "active_tables", "all_gather_matmul_class",
           "auto_prefers_fused", "candidates", "check_fields", "choose_all_gather_matmul",
           "choose_grouped_matmul", "choose_matmul_all_reduce", "choose_matmul_reduce_scatter",
           "choose_own_rows_gemm", "choose_tp1_gemm", "describe", "lookup",
           "matmul_all_reduce_class", "matmul_reduce_scatter_class", "override", "overrides",
           "reload", "shape_classes"]


def active_tables(device=LOCAL) -> tables.Active:
  """The device tables the choices on `device` come from (default: this process's GPU)."""
  return tables.active(resolve_device(device))


def _kind(device) -> str | None:
  """The shipped device table's name for `device`'s kind of GPU (the key of a rule for one kind),
  or None."""
  resolved = resolve_device(device)
  return resolved.shipped_table if resolved is not None else None


def describe(device=LOCAL) -> str:
  """Which tables the kernel choices on `device` come from, and why; and the impl="auto" rules
  that hold on this kind of GPU alone."""
  kind = _kind(device)
  own = [r for r in AUTO_RULES if r.device == kind]  # never "*": no kind is named "*"
  lines = [f"  impl='auto' also takes {r.op} at tp={r.tp} with {r.operands} operands, "
           f"{r.min_rows}-{r.max_rows if r.max_rows is not None else 'any'} rows, on this kind "
           f"only ({', '.join(r.evidence)})" for r in own]
  return "\n".join([active_tables(device).describe(), *lines])


def candidates(op: str) -> tuple[dict, ...]:
  """The choices the tuning sweep (`python -m jaxflux.bench --op gemm --candidates`) times for
  `op`'s GEMM, as override fields: every tile (all_gather_matmul) or own-rows schedule
  (matmul_reduce_scatter) with every swizzle. The table's entries are picked from these."""
  check_op(op)
  if op == "all_gather_matmul":
    return tuple({"tile": t, "swizzle": s} for t in AG_TILES for s in SWIZZLES)
  if op == "matmul_reduce_scatter":
    return tuple({"own_rows_schedule": o, "own_rows_swizzle": s}
                 for o in OWN_ROWS_SCHEDULES for s in SWIZZLES)
  raise ValueError(f"jaxflux.tuning.candidates: no sweep for {op!r}; the sweep covers "
                   "'all_gather_matmul' and 'matmul_reduce_scatter'.")


def auto_prefers_fused(op: str, tp: int, rows: int, k: int, arch: str = ARCH, *,
                       fp8: bool = False, device=LOCAL) -> bool:
  """impl="auto": whether an AUTO_RULES rule says the kernel wins for `op` (any family: dense,
  grouped, MoE) at group size tp, for `rows` rows (the GEMM's: gathered rows for
  all_gather_matmul, x's rows for matmul_reduce_scatter) and K_local `k`, with FP8 operands or
  16-bit ones, on `device` (a Device, None for no GPU kind in particular, LOCAL for this
  process's GPU). A rule for one kind of GPU holds for that kind only. No rule: XLA."""
  operands = "fp8" if fp8 else "16-bit"
  kind = None  # asked of the device only when a rule for one kind of GPU is in question
  for rule in AUTO_RULES:
    if (rule.op, rule.arch, rule.operands) != (op, arch, operands) or rule.tp not in (tp, "*"):
      continue
    if rule.device != "*":
      kind = _kind(device) if kind is None else kind
      if rule.device != kind:
        continue
    return (rows >= rule.min_rows
            and (rule.max_rows is None or rows <= rule.max_rows)
            and (rule.max_rows_times_k is None or rows * k <= rule.max_rows_times_k))
  return False
