"""A device table from a tuning sweep's rows (pure: no GPU, no files).

Each sweep row times every candidate of `jaxflux.tuning.candidates` on one per-device GEMM
against cuBLAS (XLA's dot). Per shape class, the table takes the candidate with the lowest
geometric mean of time / cuBLAS's over the class's rows; per row, an exact-shape entry where the
row's fastest candidate beats the class's choice by more than `min_gain` (so that run-to-run
noise does not pick a shape's entry).
"""
from __future__ import annotations

import dataclasses
import math

from jaxflux import tuning
from jaxflux.bench import tuning_sweep
from jaxflux.bench.tuning_sweep import OPS
from jaxflux.tuning.tables import TUNED_FIELDS, ClassEntry, ShapeEntry, fit_swizzle

MIN_GAIN = 0.01


@dataclasses.dataclass(frozen=True)
class SweptRow:
  """One sweep row as the table sees it."""
  label: str           # "llama70b-fc1 M=4096"
  op: str              # a jaxflux.tuning op
  dtype: str
  tp: int
  problem: tuple       # (rows, k, n) as the chooser keys exact shapes
  shape_class: str
  band_rows: int       # the rows a swizzle band sweeps (tables.fit_swizzle)
  ratios: dict         # candidate key (sorted field items) -> time / cuBLAS's

  def as_run(self, key: tuple) -> tuple:
    """The candidate a class entry `key` runs on this row (its swizzle fitted)."""
    return candidate_key(fit_swizzle(self.op, dict(key), self.band_rows))


def candidate_key(fields: dict) -> tuple:
  return tuple(sorted(fields.items()))


def candidate_name(key: tuple) -> str:
  return "/".join(f"{k}={v}" for k, v in key)


def _parse_candidate(variant: str, of: str) -> dict | None:
  """The fields of a sweep variant of family `of`, or None for another family or a candidate
  this build's tuning does not take (e.g. from an experimental build)."""
  parsed = tuning_sweep.parse(variant)
  if parsed is None or parsed[0] != of:
    return None
  fields = parsed[1]
  if set(fields) != set(TUNED_FIELDS[OPS[of]]):
    return None
  try:
    tuning.check_fields(OPS[of], fields)
  except ValueError:
    return None
  return fields


def swept_rows(result: dict, sms: int) -> list[SweptRow]:
  """The rows of a `python -m jaxflux.bench --op gemm --candidates` result with their classes
  (the all-gather class counts waves on `sms` SMs)."""
  out = []
  for row in result["rows"]:
    of = row.get("of")
    if of not in OPS or not row.get("candidate_ratios"):
      continue
    ratios = {}
    for variant, ratio in row["candidate_ratios"].items():
      fields = _parse_candidate(variant, of)
      if fields is not None and ratio is not None:
        ratios[candidate_key(fields)] = float(ratio)
    if not ratios:
      continue
    tp, dtype = int(row["tp"]), str(row["dtype"])
    itemsize = 1 if dtype.startswith("float8") else 2
    if of == "ag_gemm":  # x [M, K] gathered, w [K, N/tp]
      rows, k = row["per_device"]["x"]
      n = row["per_device"]["w"][1]
      shape_class = tuning.all_gather_matmul_class(rows, n, sms, rows // tp)
    else:                # own rows x [M/tp, K/tp], w [K/tp, N]
      rows, k = row["per_device"]["own_rows"]["x"]
      n = row["per_device"]["w"][1]
      shape_class = tuning.matmul_reduce_scatter_class(tp, 1, rows, k, n, itemsize)
    band_rows = rows // tp if of == "ag_gemm" else rows
    out.append(SweptRow(f"{row['name']} M={row['M']}", OPS[of], dtype, tp, (rows, k, n),
                        shape_class, band_rows, ratios))
  return out


def _geomean(values) -> float:
  values = list(values)
  return math.exp(sum(map(math.log, values)) / len(values))


def pick(rows: list[SweptRow], min_gain: float = MIN_GAIN) -> tuple[list, list]:
  """(class entries, shape entries) for the swept rows."""
  groups: dict[tuple, list[SweptRow]] = {}
  for r in rows:
    groups.setdefault((r.op, r.dtype, r.tp, r.shape_class), []).append(r)
  classes, shapes = [], []
  for (op, dtype, tp, shape_class), members in groups.items():
    common = [c for c in members[0].ratios if all(m.as_run(c) in m.ratios for m in members)]
    if not common:
      continue
    class_ratio = lambda c: _geomean(m.ratios[m.as_run(c)] for m in members)  # noqa: E731
    best = min(common, key=class_ratio)
    classes.append(ClassEntry(op, dtype, tp, shape_class, dict(best), round(class_ratio(best), 4)))
    for m in members:
      fastest = min(m.ratios, key=m.ratios.get)
      if m.ratios[fastest] < m.ratios[m.as_run(best)] * (1 - min_gain):
        shapes.append(ShapeEntry(op, dtype, tp, m.problem, dict(fastest),
                                 round(m.ratios[fastest], 4)))
  return classes, shapes


def chosen_key(row: SweptRow, classes, shapes) -> tuple | None:
  """The candidate the picked entries give a row (its shape's entry, else its class's)."""
  for e in shapes:
    if (e.op, e.dtype, e.tp, e.problem) == (row.op, row.dtype, row.tp, row.problem):
      return candidate_key(e.choice)
  for e in classes:
    if (e.op, e.dtype, e.tp, e.shape_class) == (row.op, row.dtype, row.tp, row.shape_class):
      return row.as_run(candidate_key(e.choice))
  return None


def current_key(row: SweptRow, device) -> tuple:
  """The candidate the library now chooses for a row on `device` (its tables as read)."""
  rows, k, n = row.problem
  if row.op == "all_gather_matmul":
    choice = tuning.choose_all_gather_matmul(dtype=row.dtype, tp=row.tp, rows=rows, k=k, n=n,
                                             sms=device.sms if device else 0,
                                             shard_rows=rows // row.tp, device=device).choice
  else:
    itemsize = 1 if row.dtype.startswith("float8") else 2
    choice = tuning.choose_matmul_reduce_scatter(dtype=row.dtype, tp=row.tp, batch=1, m=rows,
                                                 k=k, n=n, itemsize=itemsize,
                                                 device=device).choice
  return candidate_key({f: getattr(choice, f) for f in TUNED_FIELDS[row.op]})
