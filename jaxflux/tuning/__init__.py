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

import contextlib
import dataclasses
import threading
from typing import NamedTuple

from jaxflux.tuning import device as _device
from jaxflux.tuning import tables
from jaxflux.tuning.classes import (all_gather_matmul_class, matmul_all_reduce_class,
                                    matmul_reduce_scatter_class, shape_classes)
from jaxflux.tuning.device import Device
from jaxflux.tuning.fields import (AG_TILES, AR_TILES, DTYPES, FIELDS, GROUPED_TILES, OPS,
                                   OVERRIDE_OPS, OWN_ROWS_SCHEDULES, SWIZZLES, TILE_ROWS,
                                   AllGatherMatmulChoice, MatmulAllReduceChoice,
                                   MatmulReduceScatterChoice, check_fields, check_op)
from jaxflux.tuning.grouped import choose_grouped_matmul
from jaxflux.tuning.table import AUTO_RULES, ENTRIES, AutoRule, Entry
from jaxflux.tuning.tables import reload

ARCH = "sm90"  # the fused kernels' one target (Hopper)
LOCAL = "local"  # `device=` of the choosers: this process's first GPU (no GPU: the defaults)

__all__ = ["AG_TILES", "AR_TILES", "AUTO_RULES", "DTYPES", "ENTRIES", "FIELDS", "GROUPED_TILES",
           "LOCAL", "OPS", "OVERRIDE_OPS", "OWN_ROWS_SCHEDULES", "SWIZZLES", "TILE_ROWS",
           "AllGatherMatmulChoice", "AutoRule", "Device", "Entry", "MatmulAllReduceChoice",
           "MatmulReduceScatterChoice", "Tuned", "active_tables", "all_gather_matmul_class",
           "auto_prefers_fused", "candidates", "check_fields", "choose_all_gather_matmul",
           "choose_grouped_matmul", "choose_matmul_all_reduce", "choose_matmul_reduce_scatter",
           "choose_own_rows_gemm", "choose_tp1_gemm", "describe", "lookup",
           "matmul_all_reduce_class", "matmul_reduce_scatter_class", "override", "overrides",
           "reload", "shape_classes"]


def _resolve_device(device) -> Device | None:
  return _device.current() if device == LOCAL else device


def active_tables(device=LOCAL) -> tables.Active:
  """The device tables the choices on `device` come from (default: this process's GPU)."""
  return tables.active(_resolve_device(device))


def describe(device=LOCAL) -> str:
  """Which tables the kernel choices on `device` come from, and why."""
  return active_tables(device).describe()


_local = threading.local()


def _stack() -> list:
  if not hasattr(_local, "stack"):
    _local.stack = []
  return _local.stack


@contextlib.contextmanager
def override(op: str, **fields):
  """Replaces fields of `op`'s choice in calls traced inside the block (checked at once). `op`:
  one of OVERRIDE_OPS; "grouped_matmul" sets the tile of every grouped GEMM a
  `jaxflux.grouped_matmul` or MoE op (`all_gather_grouped_matmul`,
  `grouped_matmul_reduce_scatter`) traced in the block runs, forward and backward."""
  check_op(op, OVERRIDE_OPS)
  check_fields(op, fields)
  stack = _stack()
  stack.append((op, dict(fields)))
  try:
    yield
  finally:
    stack.pop()


def overrides(op: str) -> dict:
  """The fields the active override blocks set for `op`, inner blocks winning."""
  merged: dict = {}
  for name, fields in _stack():
    if name == op:
      merged.update(fields)
  return merged


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


def lookup(op: str, dtype: str, tp: int, shape_class: str, arch: str = ARCH) -> Entry:
  """The table's entry for these keys: the first matching, exact values before "*"."""
  matches = [e for e in ENTRIES if e.op == op and e.arch == arch and e.dtype in (dtype, "*")
             and e.tp in (tp, "*") and e.shape_class == shape_class]
  if not matches:
    raise LookupError(
        f"jaxflux.tuning: no table entry for {op} on {arch}, dtype {dtype}, tp={tp}, shape "
        f"class {shape_class!r}. Add one to jaxflux/tuning/table.py (ENTRIES), with the "
        "measurement that backs it, or run the op with impl='xla'.")
  return min(matches, key=lambda e: (e.dtype == "*", e.tp == "*"))  # min is stable


class Tuned(NamedTuple):
  choice: AllGatherMatmulChoice | MatmulReduceScatterChoice | MatmulAllReduceChoice
  shape_class: str


def _device_fields(device, op: str, dtype: str, tp: int, shape_class: str,
                   problem: tuple | None, band_rows: int) -> dict:
  """The GEMM fields the device's tables give this call (the first table that has its exact
  shape or its class), or {}."""
  for table in active_tables(device).tables:
    fields = table.fields(op, dtype, tp, shape_class, problem, band_rows)
    if fields is not None:
      return fields
  return {}


def choose_all_gather_matmul(*, dtype: str, tp: int, rows: int, k: int, n: int, sms: int,
                             shard_rows: int = 0, device=LOCAL) -> Tuned:
  """The all-gather GEMM's choice for `rows` computed rows (batch * tp * m), K k, local N `n`
  and shards of `shard_rows` rows (m; 0: unknown), on `device` (a Device, None for the sm90
  defaults alone, LOCAL for this process's GPU). A device table's exact shapes are keyed by
  (rows, k, n) of an unbatched x (rows == tp * shard_rows)."""
  op = "all_gather_matmul"
  shape_class = all_gather_matmul_class(rows, n, sms, shard_rows)
  entry = lookup(op, str(dtype), tp, shape_class)
  problem = (rows, k, n) if rows == tp * shard_rows else None
  tuned = _device_fields(_resolve_device(device), op, str(dtype), tp, shape_class, problem,
                         shard_rows)
  fields = {**entry.choice, **tuned, **overrides(op)}
  return Tuned(AllGatherMatmulChoice(**fields), shape_class)


def choose_matmul_reduce_scatter(*, dtype: str, tp: int, batch: int, m: int, k: int, n: int,
                                 itemsize: int, device=LOCAL) -> Tuned:
  """GEMM+RS's choice for m own rows per batch entry, K_local k and N n on `device` (as for
  `choose_all_gather_matmul`), normalized (see `normalize_matmul_reduce_scatter`). A device
  table's own-rows fields apply where the own-rows GEMM sums the peer's partial in its epilogue;
  its exact shapes are keyed by (m, k, n) of an unbatched x."""
  op = "matmul_reduce_scatter"
  shape_class = matmul_reduce_scatter_class(tp, batch, m, k, n, itemsize)
  entry = lookup(op, str(dtype), tp, shape_class)
  tuned = {}
  if entry.choice["reduce"] == "epilogue":
    problem = (m, k, n) if batch == 1 else None
    tuned = _device_fields(_resolve_device(device), op, str(dtype), tp, shape_class, problem,
                           m)
  forced = overrides(op)
  choice = MatmulReduceScatterChoice(**{**entry.choice, **tuned, **forced})
  return Tuned(normalize_matmul_reduce_scatter(choice, forced, tp=tp, batch=batch), shape_class)


def normalize_matmul_reduce_scatter(choice: MatmulReduceScatterChoice, forced: dict, *,
                                    tp: int, batch: int) -> MatmulReduceScatterChoice:
  """What the kernel can run: the pass reduction takes the whole push (a chunked push serves
  the epilogue only); chunks need an unbatched x; the epilogue needs tp=2. `forced`: the
  overridden fields (a conflict among them is an error, never silently resolved)."""
  op = "matmul_reduce_scatter"
  if choice.reduce == "pass" and choice.push == "chunked":
    if forced.get("push") == "chunked":
      raise ValueError(f"{op}: push='chunked' needs reduce='epilogue' (the pass sums whole "
                       "partials); got reduce='pass'. Override reduce='epilogue' too, or drop "
                       "the push override.")
    choice = dataclasses.replace(choice, push="whole")
  if choice.push == "chunked" and batch > 1:
    raise ValueError(f"{op}: push='chunked' needs an unbatched x (a batched partial's row chunks "
                     f"are not contiguous); here x has {batch} batch entries. Override "
                     "push='whole', or fold the batch into the token axis.")
  if choice.reduce == "epilogue" and tp != 2:
    raise ValueError(f"{op}: reduce='epilogue' needs tp=2 (here tp={tp}): the epilogue sums one "
                     "peer's partial. Override reduce='pass', or drop the reduce override.")
  return choice


def choose_matmul_all_reduce(*, dtype: str, tp: int, batch: int, m: int, k: int, n: int,
                             itemsize: int) -> Tuned:
  """GEMM+AllReduce's choice for x [batch, m, k] and N n, classified by its rows (batch * m).
  A chunked push needs an unbatched x (a batched output's row chunks are not contiguous): the
  table's chunked push turns whole for a batched x; an overridden one raises. k, n and itemsize
  complete the problem like the other ops' choosers take it; the classes split by rows alone,
  and no device table tunes this op yet (the sm90 defaults)."""
  del k, n, itemsize
  op = "matmul_all_reduce"
  shape_class = matmul_all_reduce_class(batch * m)
  entry = lookup(op, str(dtype), tp, shape_class)
  forced = overrides(op)
  choice = MatmulAllReduceChoice(**{**entry.choice, **forced})
  if choice.push == "chunked" and batch > 1:
    if forced.get("push") == "chunked":
      raise ValueError(f"{op}: push='chunked' needs an unbatched x (a batched output's row "
                       f"chunks are not contiguous); here x has {batch} batch entries. Override "
                       "push='whole', or fold the batch into the token axis.")
    choice = dataclasses.replace(choice, push="whole")
  return Tuned(choice, shape_class)


def choose_own_rows_gemm(*, dtype: str, rows: int, k: int, n: int, itemsize: int,
                         device=LOCAL) -> Tuned:
  """GEMM-only own-rows kernel: tuned as GEMM+RS at tp=2 tunes an own-rows GEMM of `rows` rows
  (batch 1)."""
  return choose_matmul_reduce_scatter(dtype=dtype, tp=2, batch=1, m=rows, k=k, n=n,
                                      itemsize=itemsize, device=device)


def choose_tp1_gemm(*, dtype: str, rows: int, k: int, n: int, itemsize: int) -> Tuned:
  """The GEMM an op runs at tp=1 (GEMM+AllReduce's GEMM with nothing to reduce): tuned as
  GEMM+AllReduce at tp=2 tunes an unbatched x of `rows` rows."""
  return choose_matmul_all_reduce(dtype=dtype, tp=2, batch=1, m=rows, k=k, n=n,
                                  itemsize=itemsize)


def auto_prefers_fused(op: str, tp: int, rows: int, k: int, arch: str = ARCH) -> bool:
  """impl="auto": whether an AUTO_RULES rule says the kernel wins for `op` (any family: dense,
  grouped, MoE) at group size tp, for `rows` rows (the GEMM's: gathered rows for
  all_gather_matmul, x's rows for matmul_reduce_scatter) and K_local `k`. No rule for
  (op, arch, tp): XLA."""
  for rule in AUTO_RULES:
    if (rule.op, rule.arch) == (op, arch) and rule.tp in (tp, "*"):
      return rows >= rule.min_rows and (rule.max_rows_times_k is None
                                        or rows * k <= rule.max_rows_times_k)
  return False
